"""The generic train step: exact gradient accumulation, the non-finite guard, sharded == single device."""

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from core.batch import PackedBatch
from core.config import MeshConfig, ModelConfig, OptimConfig
from core.data import to_data_batch
from core.losses import nll_loss
from core.mesh import make_mesh
from core.models import create_model
from core.optim import make_optimizer
from core.train import (
    LossOutput,
    batch_sharding,
    init_train_state,
    jit_train_step,
    make_train_step,
    place_batch,
    split_micro_batches,
    split_modules,
)

SGD = OptimConfig(name="sgd", learning_rate=1.0, schedule="constant", grad_clip_norm=None)


def make_batch(rows=8, t=24, seed=0):
    """Rows with different amounts of padding and two packed documents in some rows."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, 512, (rows, t)).astype(np.int32)
    seg = np.zeros((rows, t), np.int32)
    pos = np.zeros((rows, t), np.int32)
    for r in range(rows):
        n = rng.randint(6, t + 1)
        split = rng.randint(2, n - 2) if r % 2 else n
        seg[r, :split], seg[r, split:n] = 1, 2
        pos[r, :split], pos[r, split:n] = np.arange(split), np.arange(n - split)
    loss_mask = (seg > 0).astype(np.int32)
    loss_mask[:, :3] = 0  # a "prompt" without loss
    return {"tokens": tokens, "segment_ids": seg, "positions": pos, "loss_mask": loss_mask}


def packed(rows, micro_batches=1) -> PackedBatch:
    """The rows as the `PackedBatch` the data pipeline makes of them, for `micro_batches` micro-batches."""
    return to_data_batch({**rows, "example_ids": np.zeros_like(rows["tokens"])}, micro_batches).batch


def start(model, optim=SGD):
    """(graphdef, train state, frozen rest, tx) of a whole model trained by `optim`."""
    graphdef, params, rest = split_modules(model, nnx.Param)
    tx = make_optimizer(optim, 10, params)
    return graphdef, init_train_state(params, tx, seed=0), rest, tx


def run_steps(model_cfg, batches, micro_batches, mesh=None, optim=SGD):
    model = create_model(model_cfg, mesh, seed=0)
    graphdef, state, rest, tx = start(model, optim)
    step = jit_train_step(make_train_step(graphdef, nll_loss, tx), state)
    metrics = []
    for b in batches:
        b = split_micro_batches(packed(b, micro_batches), micro_batches)
        if mesh is not None:
            b = place_batch(b, mesh)
            with jax.set_mesh(mesh):
                state, m = step(state, b, rest)
        else:
            state, m = step(state, b, rest)
        metrics.append(jax.device_get(m))
    return state, metrics


def max_param_diff(a, b):
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params))
    )


def test_micro_batches_give_the_same_update():
    cfg = ModelConfig(family="qwen2", attention_bias=True)
    batch = make_batch()
    one, m1 = run_steps(cfg, [batch], 1)
    four, m4 = run_steps(cfg, [batch], 4)
    assert (
        m1[0].denominator
        == m4[0].denominator
        == (batch["loss_mask"][:, 1:] * (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])).sum()
    )
    assert abs(float(m1[0].loss) - float(m4[0].loss)) <= 1e-6
    # SGD with lr 1: the update is minus the gradient
    assert max_param_diff(one, four) <= 1e-6


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ScaledBatch:
    """A method's batch: the packed batch and one array of its own (as a method adds advantages, log-probs)."""

    packed: Any
    scale: Any


def test_non_finite_step_leaves_state_untouched():
    cfg = ModelConfig()
    graphdef, state, rest, tx = start(create_model(cfg, seed=0))

    def loss_fn(model, batch, rng):
        out = nll_loss(model, batch.packed, rng)
        return LossOutput(out.total * batch.scale.sum(), out.denominator)

    step = jax.jit(make_train_step(graphdef, loss_fn, tx))
    before = jax.tree.map(np.asarray, state.params)
    batch = split_micro_batches(ScaledBatch(packed(make_batch()), np.full((8, 1), np.nan, np.float32)), 1)
    state, m = step(state, batch, rest)
    assert float(m.finite) == 0.0 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    batch = ScaledBatch(batch.packed, np.ones_like(batch.scale))
    state, m = step(state, batch, rest)
    assert float(m.finite) == 1.0
    assert any(
        not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))
    )


def test_a_batch_without_loss_tokens_takes_no_optimizer_step():
    """Every token masked (e.g. a mini-batch of zero-variance groups): AdamW with weight decay would still move the
    parameters and its moments on a zero gradient; the step leaves both untouched, and the next real batch
    updates as if the empty one had never been there."""
    cfg = ModelConfig()
    adamw = OptimConfig(name="adamw", learning_rate=1e-2, schedule="constant", weight_decay=0.1)
    batch = packed(make_batch())
    empty = packed({**make_batch(), "loss_mask": np.zeros_like(make_batch()["loss_mask"])})
    states = []
    for batches in ([empty, batch], [batch]):
        graphdef, state, rest, tx = start(create_model(cfg, seed=0), adamw)
        step = jax.jit(make_train_step(graphdef, nll_loss, tx))
        first = jax.tree.map(np.asarray, (state.params, state.opt_state))
        for _i, b in enumerate(batches):
            state, m = step(state, split_micro_batches(b, 1), rest)
            if b is empty:
                assert float(m.empty) == 1.0 and float(m.finite) == 1.0
                after = jax.tree.map(np.asarray, (state.params, state.opt_state))
                for a, c in zip(jax.tree.leaves(first), jax.tree.leaves(after)):
                    np.testing.assert_array_equal(a, c)
            else:
                assert float(m.empty) == 0.0
        states.append(state)
    assert max_param_diff(states[0], states[1]) == 0.0


@pytest.mark.parametrize("mesh_cfg,micro", [(MeshConfig(fsdp=8), 1), (MeshConfig(data=2, fsdp=2, tensor=2), 2)])
def test_sharded_training_matches_single_device(mesh_cfg, micro):
    cfg = ModelConfig(family="llama")
    batches = [make_batch(seed=s) for s in range(3)]
    mesh = make_mesh(mesh_cfg)
    sharded, ms = run_steps(cfg, batches, micro, mesh=mesh, optim=SGD.model_copy(update={"learning_rate": 0.5}))
    single, m1 = run_steps(cfg, batches, micro, optim=SGD.model_copy(update={"learning_rate": 0.5}))
    q = sharded.params["layers"]["attn"]["q_proj"]["kernel"][...]
    assert len(q.sharding.device_set) == 8
    for a, b in zip(ms, m1):
        assert abs(float(a.loss) - float(b.loss)) <= 1e-5
    assert max_param_diff(sharded, single) <= 1e-5


@pytest.mark.parametrize("projections", [False, True])
def test_optimizer_moments_are_sharded_like_parameters(projections):
    """Also for a method's module tree (a model and a feature projection trained with it, distillation's): every
    moment keeps its parameter's sharding, the projection's its own (replicated)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import DistillModules, trainable

    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    model = create_model(ModelConfig(), mesh)
    tree, which = model, nnx.Param
    if projections:
        extra = feature_projections([(1, 1)], 64, 96, 0)
        nnx.update(extra, jax.device_put(nnx.state(extra), NamedSharding(mesh, PartitionSpec())))
        tree, which = DistillModules(model, extra), trainable(nnx.Param)
    _, trained, _ = split_modules(tree, which)
    tx = make_optimizer(OptimConfig(name="adamw"), 10, trained)
    state = init_train_state(trained, tx, seed=0)
    params = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert any("kernels" in p for p in params) == projections
    moments = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        key = jax.tree_util.keystr(path)
        match = [p for p in params if key.endswith(p)]
        if match:
            assert leaf.sharding == params[match[0]].sharding, key
            moments += 1
        else:
            assert leaf.ndim == 0 and leaf.sharding.is_fully_replicated, key
    assert moments == 2 * len(params)  # mu and nu for every parameter
    q = next(x for p, x in params.items() if "q_proj" in p and "kernel" in p)
    assert not q.sharding.is_fully_replicated  # (so the sharded matches above are not all trivially replicated)


def test_a_batch_is_split_into_the_micro_batches_it_was_packed_for():
    """`target_index` is local to each packing group: a batch packed for 2 groups cut into 1 or 4 micro-batches
    would point targets at other rows, so the split is refused, naming both counts."""
    batch = packed(make_batch(), micro_batches=2)
    assert batch.groups == 2
    split_micro_batches(batch, 2)
    for wrong in (1, 4):
        with pytest.raises(ValueError, match=rf"packed for 2 packing group\(s\) but is split into {wrong} micro"):
            split_micro_batches(ScaledBatch(batch, np.ones((8, 1), np.float32)), wrong)


def test_batch_shards_is_what_batch_sharding_splits_rows_into():
    from core.config import MeshConfig
    from core.mesh import make_mesh, single_device_mesh
    from core.train import batch_shards

    assert batch_shards(single_device_mesh()) == 1
    for mesh_cfg in (MeshConfig(data=2, fsdp=4), MeshConfig(fsdp=2, tensor=4)):
        mesh = make_mesh(mesh_cfg, jax.devices())
        n = batch_shards(mesh)
        sharding = batch_sharding(mesh, (1, n, 16))
        rows = {(idx[1].start, idx[1].stop) for idx in sharding.devices_indices_map((1, n, 16)).values()}
        assert len(rows) == n  # each device holds its own row
    assert batch_shards(make_mesh(MeshConfig(data=2, fsdp=4), jax.devices())) == 8


@pytest.mark.parametrize("slots", [16, 128, 256, 640, 960, 4096])
def test_scored_counts_cover_every_real_target_in_few_sizes(slots):
    """`with_scored`: the head scores at least every real target of the fullest micro-batch, at most the slots,
    in at most 16 distinct counts per slot size (each is a compilation), and steps of 64 targets once the
    slots pass 256 (a coarser step would run the vocabulary-sized head on ~10% padding targets at 56M)."""
    from core.batch import with_scored

    counts = set()
    for most in range(1, slots + 1):
        mask = np.zeros((2, slots), np.int32)  # two micro-batches of one row of `slots` targets
        mask[0, :most] = 1
        mask[1, : most // 2] = 1
        batch = PackedBatch(
            tokens=np.zeros((2, 8), np.int32),
            positions=np.zeros((2, 8), np.int32),
            segment_ids=np.ones((2, 8), np.int32),
            branch_ids=np.zeros((2, 8), np.int32),
            target_index=np.zeros((2, slots), np.int32),
            target_ids=np.zeros((2, slots), np.int32),
            target_mask=mask,
            groups=2,
        )
        scored = with_scored(batch).scored
        assert most <= scored <= slots, (most, scored)
        counts.add(scored)
    assert len(counts) <= 16, sorted(counts)
    if 256 < slots <= 1024:
        assert max(b - a for a, b in zip(sorted(counts), sorted(counts)[1:])) == 64


def test_a_learner_reuses_a_larger_compiled_target_count_instead_of_compiling_again():
    """Two batches of the same array shapes whose real targets fall in different `scored` buckets: after the fuller
    one, the sparser one is padded into the count already compiled (`core.batch.CompiledCounts`), so the update
    compiles once; in the other order the smaller count came first and the fuller batch needs its own. Both
    updates run, on a non-zero gradient."""
    from core.learner import Learner

    full = make_batch(rows=8, t=24, seed=0)
    sparse = {**full, "loss_mask": full["loss_mask"] * (np.arange(8) >= 2)[:, None]}  # 61 of its 84 targets
    assert [x.shape for x in jax.tree.leaves(packed(sparse))] == [x.shape for x in jax.tree.leaves(packed(full))]
    scored = lambda rows: split_micro_batches(packed(rows), 1).scored
    assert scored(sparse) < scored(full) <= 2 * scored(sparse)  # the same shapes, in neighbouring buckets
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    for order, compiles in (((full, sparse), 1), ((sparse, full), 2)):
        learner = Learner(create_model(ModelConfig(), mesh, seed=0), mesh, nll_loss, SGD, total_updates=2)
        for rows in order:
            update = learner.update(packed(rows))
            assert update.finite and not update.empty and update.grad_norm > 0
        assert learner.compiled_shapes == compiles, order
