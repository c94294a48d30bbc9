"""Schedules against hand-computed values; weight-decay mask; freezing; Muon."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import ModelConfig, OptimConfig
from core.models import create_model
from core.optim import by_part, held_for, make_optimizer, make_schedule, part_of, trainable_paths


def lr(cfg, total, steps):
    s = make_schedule(cfg, total)
    return [float(s(i)) for i in steps]


def test_constant_with_warmup():
    c = OptimConfig(schedule="constant", learning_rate=1.0, warmup_steps_fraction=0.1)
    assert lr(c, 100, [0, 5, 10, 50, 99]) == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])


def test_cosine_with_warmup():
    c = OptimConfig(schedule="cosine", learning_rate=2.0, warmup_steps_fraction=0.2, learning_rate_final_fraction=0.1)
    total, warm = 50, 10

    def hand(i):
        if i < warm:
            return 2.0 * i / warm
        t = (i - warm) / (total - warm)
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    steps = [0, 4, 10, 20, 30, 45, 50]
    assert lr(c, total, steps) == pytest.approx([hand(i) for i in steps], rel=1e-5)


def test_wsd():
    c = OptimConfig(
        schedule="wsd",
        learning_rate=1.0,
        warmup_steps_fraction=0.1,
        wsd_decay_steps_fraction=0.2,
        learning_rate_final_fraction=0.0,
    )
    # 100 steps: warm-up 0-10, stable 10-80, linear decay 80-100 to 0
    assert lr(c, 100, [0, 5, 10, 50, 79, 80, 90, 100]) == pytest.approx([0, 0.5, 1, 1, 1, 1, 0.5, 0], abs=1e-6)


@functools.lru_cache(maxsize=1)
def tiny_params():
    model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
    return model, nnx.state(model)


def grads_like(params, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 100))
    return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), params)


def test_weight_decay_skips_norms_and_biases():
    _, params = tiny_params()
    c = OptimConfig(name="adamw", learning_rate=0.1, weight_decay=0.5, schedule="constant", grad_clip_norm=None)
    tx = make_optimizer(c, 10, params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)  # zero gradient: only weight decay moves things
    flat_u, flat_p = dict(nnx.to_flat_state(updates)), dict(nnx.to_flat_state(params))
    for path, u in flat_u.items():
        name = ".".join(map(str, path))
        if name.endswith((".scale", ".bias")):
            assert not np.asarray(u[...]).any(), name
        else:
            np.testing.assert_allclose(np.asarray(u[...]), -0.1 * 0.5 * np.asarray(flat_p[path][...]), rtol=1e-6)


def _regex_learner(regex: str):
    from core.learner import Learner
    from core.losses import nll_loss
    from core.mesh import single_device_mesh

    model, _ = tiny_params()
    c = OptimConfig(name="adamw", learning_rate=0.1, trainable_regex=regex, schedule="constant")
    return Learner(model, single_device_mesh(), nll_loss, c, total_updates=3)


def test_trainable_regex_is_the_learners_filter_frozen_parameters_get_no_gradient_or_state():
    """`optim.trainable_regex` narrows what trains: the learner's trainable state holds the matching parameters
    alone (no gradient buffer, no moment for the rest, and a checkpoint holds only them); an update moves them and
    leaves every other parameter as it was."""
    from tests.test_train_step import make_batch, packed

    learner = _regex_learner(r"mlp\.")
    trained = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.params)]
    frozen = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.rest)]
    assert trained and all("mlp." in p for p in trained), trained
    assert any("attn" in p for p in frozen) and not any("mlp." in p for p in frozen), frozen
    moments = [leaf for leaf in jax.tree.leaves(learner.state.opt_state) if leaf.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(learner.params))
    before = jax.tree.map(np.asarray, learner.rest)
    trained_before = jax.tree.map(np.asarray, learner.params)
    update = learner.update(packed(make_batch(rows=4, t=12)), 1)
    assert update.applied and update.grad_norm > 0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(learner.rest), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    moved = [
        not np.array_equal(x, np.asarray(y))
        for x, y in zip(jax.tree.leaves(trained_before), jax.tree.leaves(learner.params))
    ]
    assert all(moved)


def test_trainable_regex_matching_nothing():
    with pytest.raises(ValueError, match="matches no parameter"):
        _regex_learner("nothing_like_this")


@pytest.mark.parametrize("name", ["sgd", "muon"])
def test_other_optimizers_step(name):
    _, params = tiny_params()
    tx = make_optimizer(OptimConfig(name=name, learning_rate=0.01, schedule="constant"), 10, params)
    updates, _ = jax.jit(tx.update)(grads_like(params), tx.init(params), params)
    assert all(np.isfinite(np.asarray(u)).all() and np.asarray(u).any() for u in jax.tree.leaves(updates))


def test_trainable_regex_reads_the_paths_of_a_module_tree():
    """In a method's module tree (a model and a feature projection trained with it) `trainable_regex` matches each
    parameter's path in the tree: `mlp\\.|projections` trains the model's MLPs and the projection, nothing else
    of the model."""
    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import DistillModules, trainable

    model, _ = tiny_params()
    tree = DistillModules(model, feature_projections([(1, 1)], 64, 32, seed=0))
    params = nnx.state(tree, trainable_paths(trainable(nnx.Param), r"mlp\.|projections"))
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(params)]
    assert any(p.startswith("projections.") for p in paths) and any(p.startswith("model.") for p in paths)
    assert all(p.startswith("projections.") or ".mlp." in p for p in paths), paths
    # One clip at optim.grad_clip_norm over every trainable parameter of the tree (SGD shows it: AdamW's first step
    # does not depend on the scale).
    whole = nnx.state(tree, trainable(nnx.Param))
    tx = make_optimizer(OptimConfig(name="sgd", learning_rate=0.1, schedule="constant", grad_clip_norm=1.0), 10, whole)
    grads = jax.tree.map(jnp.ones_like, whole)
    updates, _ = tx.update(grads, tx.init(whole), whole)
    norm = np.sqrt(sum(x.size for x in jax.tree.leaves(whole)))  # of the all-ones gradient of the whole tree
    np.testing.assert_allclose(np.asarray(updates["projections"]["kernels"][0]), -0.1 / norm, rtol=1e-5)


class _TwoParts(nnx.Module):
    """A trainable state of two parts, as PPO's (`model`, `critic`)."""

    def __init__(self):
        self.model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.critic = nnx.Linear(4, 1, rngs=nnx.Rngs(1))


def _grads(params, model_scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype) * (model_scale if path[0].key == "model" else 1),
        params,
    )


def _critic(tree):
    return [np.asarray(x) for x in jax.tree.leaves(part_of(tree, "critic"))]


def test_each_part_is_clipped_by_its_own_gradients_norm():
    """`by_part`: a policy gradient 1000x larger leaves the critic's update as it was (each part's clip reads its
    own norm); one optimizer over both (a joint clip) would shrink the critic's with it."""
    params = nnx.state(_TwoParts(), nnx.Param)
    optim = OptimConfig(name="sgd", learning_rate=1.0, schedule="constant", grad_clip_norm=1.0)
    parts = by_part({k: make_optimizer(optim, 10, part_of(params, k)) for k in ("model", "critic")})
    joint = make_optimizer(optim, 10, params)
    for tx, same in ((parts, True), (joint, False)):
        small, _ = tx.update(_grads(params), tx.init(params), params)
        large, _ = tx.update(_grads(params, model_scale=1000.0), tx.init(params), params)
        gap = max(float(np.abs(a - b).max()) for a, b in zip(_critic(small), _critic(large)))
        assert (gap == 0.0) == same, (same, gap)
    assert jax.tree.structure(small) == jax.tree.structure(params)  # the updates come back in the state's shape


def test_a_held_part_starts_as_a_fresh_optimizer_at_its_first_update():
    """`held_for(tx, 2)`: two zero updates, `tx`'s state untouched (AdamW's moments, its count and schedule), then
    exactly the update a fresh `tx` makes on that gradient (its first Adam step: learning rate x sign, here with a
    warm-up schedule that starts at its own step 0)."""
    params = nnx.state(_TwoParts(), nnx.Param)
    optim = OptimConfig(learning_rate=1e-2, schedule="cosine", warmup_steps_fraction=0.5, weight_decay=0.0)
    model = part_of(params, "model")
    held = held_for(make_optimizer(optim, 4, model), 2)
    state = held.init(model)
    for seed in (1, 2):
        out, state = held.update(part_of(_grads(params, seed=seed), "model"), state, model)
        assert not any(np.asarray(x).any() for x in jax.tree.leaves(out))
    fresh = make_optimizer(optim, 4, model)
    grads = part_of(_grads(params, seed=3), "model")
    got, _ = held.update(grads, state, model)
    want, _ = fresh.update(grads, fresh.init(model), model)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the warm-up schedule's step 0 is 0: its second update is the first that moves, as a fresh optimizer's
    got, _ = held.update(grads, held.update(grads, state, model)[1], model)
    want, _ = fresh.update(grads, fresh.update(grads, fresh.init(model), model)[1], model)
    assert any(np.asarray(x).any() for x in jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
