"""Orbax checkpoints: full state round trip, another mesh, params only, mismatched models, keep-N."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core.checkpoint import Checkpointer, CheckpointMismatch
from core.checkpoint_models import load_params, save_params
from core.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig
from core.mesh import make_mesh
from core.models import abstract_sharded_state, create_model
from core.optim import make_optimizer
from core.train import TrainState, init_train_state, split_modules
from tests.helpers import pipeline, saved_tensors

ADAM = OptimConfig(name="adamw", learning_rate=1e-3, schedule="constant")


def make_state(model_cfg, mesh=None, seed=0, tree=None, trainable=nnx.Param):
    """(graphdef, a train state with non-trivial moments) of a model, or of a method's module tree `tree(model)`."""
    model = create_model(model_cfg, mesh, seed=seed)
    graphdef, params, _ = split_modules(model if tree is None else tree(model, seed), trainable)
    tx = make_optimizer(ADAM, 10, params)
    state = init_train_state(params, tx, seed=seed)
    # give the optimizer non-trivial moments
    grads = jax.jit(lambda ps: jax.tree.map(lambda p: p * 0.5 + 0.1, ps))(state.params)
    _updates, opt_state = jax.jit(tx.update)(grads, state.opt_state, state.params)
    state = TrainState(state.params, opt_state, state.step + 7, state.rng)
    return graphdef, state


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_with_data_iterator(tmp_path, arithmetic_tokenizer):
    cfg = Config(model=ModelConfig())
    _, state = make_state(cfg.model)
    records = [{"text": f"Calculate {i} + 1."} for i in range(50)]
    dcfg = DataConfig(seq_len=16)
    it = iter(pipeline(records, dcfg, 2, arithmetic_tokenizer))
    next(it), next(it)
    ckpt = Checkpointer(tmp_path / "ck", keep=2, async_save=True)
    ckpt.save(state, it, cfg)
    ckpt.wait()
    expected_next = next(it)

    _, target = make_state(cfg.model, seed=1)  # different values, same structure
    it2 = iter(pipeline(records, dcfg, 2, arithmetic_tokenizer))
    restored, meta = Checkpointer(tmp_path / "ck").restore(7, target, it2, cfg)
    assert meta["step"] == 7 and int(restored.step) == 7
    leaves_equal(restored.params, state.params)
    leaves_equal(restored.opt_state, state.opt_state)
    leaves_equal(restored.rng, state.rng)
    got = next(it2)
    np.testing.assert_array_equal(got.example_ids, expected_next.example_ids)
    for a, b in zip(jax.tree.leaves(got.batch), jax.tree.leaves(expected_next.batch), strict=True):
        np.testing.assert_array_equal(a, b)


def test_restore_onto_a_different_mesh(tmp_path):
    cfg = Config(model=ModelConfig())
    _, state = make_state(cfg.model, make_mesh(MeshConfig(fsdp=8)))
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(state, None, cfg)
    mesh2 = make_mesh(MeshConfig(fsdp=2, tensor=4))
    _, target = make_state(cfg.model, mesh2, seed=3)
    restored, _ = ckpt.restore(7, target, None, cfg)
    leaves_equal(restored.params, state.params)
    q = restored.params["layers"]["attn"]["q_proj"]["kernel"][...]
    assert q.sharding.mesh.shape["tensor"] == 4 and q.sharding.spec == P(None, "fsdp", "tensor", None)


def test_params_only(tmp_path):
    model = create_model(ModelConfig(), seed=0)
    save_params(tmp_path / "p", nnx.state(model))
    _, target = abstract_sharded_state(ModelConfig(), make_mesh(MeshConfig(fsdp=4), jax.devices()[:4]))
    loaded = load_params(tmp_path / "p", target)
    leaves_equal(loaded, nnx.state(model))
    with pytest.raises(FileNotFoundError, match="no parameter checkpoint"):
        load_params(tmp_path / "missing", target)


def test_checkpoint_from_a_different_model_is_refused_and_kept(tmp_path):
    cfg = Config(model=ModelConfig())
    _, state = make_state(cfg.model)
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(state, None, cfg)
    other = Config(model=ModelConfig(hidden_size=96, intermediate_size=160))
    _, target = make_state(other.model)
    with pytest.raises(CheckpointMismatch) as e:
        ckpt.restore(7, target, None, other)
    msg = str(e.value)
    assert "model.hidden_size: checkpoint 64, this run 96" in msg
    assert "tensor embed.embedding: checkpoint (512, 64), this run (512, 96)" in msg
    # the checkpoint is intact and still restores into the right model
    restored, _ = ckpt.restore(7, make_state(cfg.model, seed=2)[1], None, cfg)
    leaves_equal(restored.params, state.params)


def test_keep_n(tmp_path):
    cfg = Config(model=ModelConfig())
    _, state = make_state(cfg.model)
    ckpt = Checkpointer(tmp_path / "ck", keep=2, async_save=True)
    for i in range(4):
        ckpt.save(TrainState(state.params, state.opt_state, state.step + i, state.rng), None, cfg)
    ckpt.wait()
    assert ckpt.all_steps() == [9, 10] and ckpt.latest_step() == 10


def _two_checkpoints(directory):
    cfg = Config(model=ModelConfig())
    _, state = make_state(cfg.model)
    ckpt = Checkpointer(directory, keep=3, async_save=False)
    first = ckpt.save(state, None, cfg)
    later = TrainState(jax.tree.map(lambda p: p + 1.0, state.params), state.opt_state, state.step + 1, state.rng)
    second = ckpt.save(later, None, cfg)
    return cfg, state, ckpt, first, second


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, capsys):
    cfg, state, _ckpt, first, second = _two_checkpoints(tmp_path / "ck")
    files = sorted(
        (p for p in (tmp_path / "ck" / str(second) / "params").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    biggest = files[-1]
    if damage == "truncate":
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    else:
        biggest.unlink()
    _, target = make_state(cfg.model, seed=5)
    restored, meta, step = Checkpointer(tmp_path / "ck").restore_latest(target, None, cfg)
    assert step == first and meta["step"] == first
    leaves_equal(restored.params, state.params)
    out = capsys.readouterr().out
    assert f"checkpoint {tmp_path / 'ck' / str(second)} cannot be restored" in out and "moved to" in out
    again = Checkpointer(tmp_path / "ck")
    assert again.all_steps() == [first] and list((tmp_path / "ck").glob(f"corrupt-{second}-*"))
    again.save(TrainState(state.params, state.opt_state, state.step + 1, state.rng), None, cfg)  # step reusable
    assert again.latest_step() == second


def test_only_corrupt_checkpoints_is_a_clear_error(tmp_path):
    from core.checkpoint import NoUsableCheckpoint

    cfg, _state, _ckpt, first, second = _two_checkpoints(tmp_path / "ck")
    for step in (first, second):
        (tmp_path / "ck" / str(step) / "meta" / "metadata").write_text("{not json")
    with pytest.raises(NoUsableCheckpoint, match=f"no checkpoint in {tmp_path / 'ck'} could be restored"):
        Checkpointer(tmp_path / "ck").restore_latest(make_state(cfg.model)[1], None, cfg)


def test_kill_9_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    directory = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, str(root / "tests" / "ckpt_worker.py"), str(directory)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "saving"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftovers = [p.name for p in directory.iterdir() if p.name != "1"]
    assert leftovers and all("tmp" in name for name in leftovers), leftovers  # killed mid-save, not after
    ckpt = Checkpointer(directory)
    assert ckpt.all_steps() == [1]
    target = TrainState(
        nnx.State({"w": jax.numpy.zeros((2048, 8192))}),
        {"m": jax.numpy.ones((4,))},
        jax.numpy.asarray(0, jax.numpy.int32),
        jax.random.key(1),
    )
    restored, _, step = ckpt.restore_latest(target, None, Config(model=ModelConfig()))
    assert step == 1 and float(restored.params["w"].max()) == float(restored.params["w"].min()) == 1.0
    ckpt.close()
    assert sorted(p.name for p in directory.iterdir()) == ["1"]  # the half-written one is cleaned up


def test_loading_a_checkpoint_runs_no_code_from_the_run_directory(tmp_path):
    """A run directory is not trusted: its saved config names a reward plugin (here one that leaves a marker when
    imported, then one that is gone); loading the model reads the config as data and imports nothing."""
    from core.checkpoint_models import load_checkpoint_model, load_model_from
    from core.config_loader import load_config
    from posttrain.config import PostTrainConfig

    plugin = tmp_path / "plugin.py"
    marker = tmp_path / "imported"
    plugin.write_text(
        f"open({str(marker)!r}, 'w').close()\ndef fn(prompts, completions, **_):\n    return [0.0] * len(completions)\n"
    )
    cfg = load_config(overrides=[f"reward.functions=[{{fn: {plugin}:fn}}]"], schema=PostTrainConfig)
    marker.unlink()
    _, state = make_state(cfg.model)
    Checkpointer(tmp_path / "run" / "checkpoints", async_save=False).save(state, None, cfg)
    for gone in (False, True):
        if gone:
            plugin.unlink()
        _model, model_cfg, saved = load_checkpoint_model(tmp_path / "run")
        assert model_cfg == cfg.model and saved["reward"]["functions"][0]["fn"] == f"{plugin}:fn"
        leaves_equal(nnx.state(load_model_from(tmp_path / "run")), state.params)
        restored, _ = Checkpointer(tmp_path / "run" / "checkpoints").restore(
            7, make_state(cfg.model, seed=1)[1], None, cfg
        )
        leaves_equal(restored.params, state.params)
        assert not marker.exists()


def test_a_module_tree_checkpoints_what_trains_and_names_what_differs(tmp_path):
    """A method's module tree (a model, a feature projection trained with it, a frozen teacher): the checkpoint holds
    the trainable part with its optimizer moments, exactly, and not the teacher; a run whose tree differs (another
    projection width, no projection) does not restore it and names the tensor (the checkpoint is kept)."""
    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import DistillModules, trainable

    cfg = Config(model=ModelConfig())

    def tree(width):
        def build(model, seed):
            teacher = create_model(cfg.model, seed=seed + 100)
            return DistillModules(model, feature_projections([(1, 1)], 64, width, seed=seed), teacher)

        return build

    state = make_state(cfg.model, tree=tree(96), trainable=trainable(nnx.Param))[1]
    assert "teacher" not in state.params and "projections" in state.params
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(state, None, cfg)
    restored, _ = ckpt.restore(
        7, make_state(cfg.model, seed=1, tree=tree(96), trainable=trainable(nnx.Param))[1], None, cfg
    )
    leaves_equal(restored.opt_state, state.opt_state)
    leaves_equal(restored.params, state.params)
    assert np.abs(np.asarray(restored.params["projections"]["kernels"][0][...])).max() > 0
    saved = saved_tensors(tmp_path / "ck" / "7")
    assert "projections.kernels.0" in saved and not [p for p in saved if "teacher" in p]

    with pytest.raises(
        CheckpointMismatch, match=r"tensor projections\.kernels\.0: checkpoint \(64, 96\), this run \(64, 80\)"
    ):
        ckpt.restore(7, make_state(cfg.model, seed=1, tree=tree(80), trainable=trainable(nnx.Param))[1], None, cfg)
    plain = Checkpointer(tmp_path / "plain", async_save=False)
    plain.save(make_state(cfg.model)[1], None, cfg)
    with pytest.raises(CheckpointMismatch, match=r"tensor projections\.kernels\.0: checkpoint None"):
        plain.restore(7, make_state(cfg.model, seed=1, tree=tree(96), trainable=trainable(nnx.Param))[1], None, cfg)
    assert ckpt.all_steps() == [7] and plain.all_steps() == [7]


def test_the_frozen_fingerprint_holds_across_meshes_and_tells_other_weights_apart():
    """A frozen tensor's record on 8 devices is accepted on 1 (and back) though its sum cancels to a small value
    (each order rounds differently, by float32 steps of its terms, not of the sum); another tensor of the same
    shape and scale is refused by name."""
    from jax.sharding import NamedSharding

    from core.checkpoint_models import check_frozen, frozen_fingerprint

    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((2048, 512)) * 0.02).astype(np.float32)
    weights -= weights.mean(dtype=np.float64).astype(np.float32)  # the plain sum cancels to ~0
    mesh = make_mesh(MeshConfig(fsdp=8), jax.devices()[:8])
    sharded = {"embed": jax.device_put(weights, NamedSharding(mesh, P("fsdp", None)))}
    one = {"embed": jax.device_put(weights, jax.devices()[0])}
    many, single = frozen_fingerprint(sharded), frozen_fingerprint(one)
    total, squares, magnitude = single["embed"]
    assert abs(total) < 1e-3 * magnitude and squares > 0  # the case the old relative-to-the-sum bound got wrong
    check_frozen(many, single, "8 devices")
    check_frozen(single, many, "1 device")
    # the float32 error of a sum of 1M terms in another order is up to ~1e-5 of their magnitude: still accepted
    check_frozen(single, {"embed": [total + 1e-5 * magnitude, squares, magnitude]}, "reordered")
    other = (rng.standard_normal(weights.shape) * 0.02).astype(np.float32)
    with pytest.raises(CheckpointMismatch, match=r"embed: sum"):
        check_frozen(single, frozen_fingerprint({"embed": jax.numpy.asarray(other)}), "other weights")


def test_a_checkpoint_of_another_optimizer_is_refused_and_kept(tmp_path):
    """The same model trained with another optimizer (SGD's state against AdamW's; PPO's before and after it had
    an optimizer per part): a `CheckpointMismatch` naming the optimizer state, and the checkpoint stays where it is
    (not moved aside as corrupt)."""
    cfg = Config(model=ModelConfig())
    _, state = make_state(cfg.model)
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(state, None, cfg)
    sgd = make_optimizer(OptimConfig(name="sgd", learning_rate=1e-3, schedule="constant"), 10, state.params)
    target = init_train_state(state.params, sgd, seed=0)
    with pytest.raises(CheckpointMismatch, match="optimizer state"):
        ckpt.restore_latest(target, None, cfg)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["7"]
    restored, _, _ = ckpt.restore_latest(make_state(cfg.model, seed=2)[1], None, cfg)
    leaves_equal(restored.opt_state, state.opt_state)
