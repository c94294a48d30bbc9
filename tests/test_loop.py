"""The training loop: hook cadence, non-finite policies, SIGTERM, run-directory artifacts."""

import dataclasses
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.batch_source import DatasetSource, Evaluation
from core.config_loader import load_config
from core.data import DataBatch
from core.loop import NonFiniteLoss
from core.losses import nll_loss, perplexity
from core.mesh import make_mesh
from core.method import Method
from core.models import create_model
from core.train import LossOutput
from core.train_loop import TrainLoop
from core.trainer import Trainer
from tests.helpers import pipeline

RECORDS = [{"text": f"Calculate {i} * 3.\nAnswer: {3 * i}"} for i in range(64)]


def config(tmp_path, *overrides):
    return load_config(
        "recipes/configs/pretrain_tiny.yml",
        [
            f"run.run_dir={tmp_path}",
            "train.steps=8",
            "train.batch_size=2",
            "train.log_every=2",
            "train.eval_every=4",
            "data.seq_len=32",
            "data.packing=false",
            "data.shuffle=false",
            "data.eval_fraction=0.1",
            "model.hidden_size=64",
            "model.intermediate_size=128",
            "model.num_layers=1",
            "model.head_dim=16",
            "checkpoint.every_steps=3",
            "checkpoint.async_save=false",
            "logging.peak_tflops=1.0",
            *overrides,
        ],
    )


POISON = 511  # a token id the poisoned loss turns into NaN


def trainer(cfg, tokenizer, loss_fn=nll_loss, on_batch=None, poison=False):
    """A TrainLoop on RECORDS; with `poison`, the batch holding example 4 (step 3 with batch 2, no shuffle) carries
    the POISON token, inside the (checkpointable) Grain pipeline."""
    mesh = make_mesh(cfg.mesh)
    model = create_model(cfg.model, mesh)
    data = pipeline(RECORDS, cfg.data, cfg.train.batch_size, tokenizer)
    if poison:
        data.dataset = data.dataset.map(poisoned)
    held = Evaluation(lambda: pipeline(RECORDS, cfg.data, cfg.train.batch_size, tokenizer, split="eval"), perplexity)
    method = LossOnly(loss_fn)
    return TrainLoop(
        cfg,
        Trainer(cfg, method, model, mesh, cfg.run.run_dir),
        DatasetSource(data, evaluation=held),
        tokenizer_dir=tokenizer,
        on_batch=on_batch,
    )


class LossOnly(Method):
    """A method that is its loss alone (the contract's defaults for the rest)."""

    name = "pretraining"

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def loss(self, cfg):
        return self.loss_fn


def poisoned(data: DataBatch) -> DataBatch:
    if (data.example_ids == 4).any():
        tokens = data.batch.tokens.copy()
        tokens[0, 0] = POISON
        data = DataBatch(dataclasses.replace(data.batch, tokens=tokens), data.example_ids)
    return data


def poisoned_loss(model, batch, rng):
    """NaN whenever the batch carries the POISON token."""
    out = nll_loss(model, batch, rng)
    return LossOutput(out.total * jnp.where((batch.tokens == POISON).any(), jnp.nan, 1.0), out.denominator)


def test_cadence_and_artifacts(tmp_path, arithmetic_tokenizer, capsys):
    cfg = config(tmp_path)
    trainer(cfg, arithmetic_tokenizer).fit()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))  # every step's metrics are kept
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
    assert [l.split(" | ")[0] for l in lines] == ["step 2/8", "step 4/8", "step 6/8", "step 8/8"]  # train.log_every
    assert [r["step"] for r in rows if "eval/loss" in r] == [4, 8]
    assert all(r["eval/perplexity"] == pytest.approx(np.exp(r["eval/loss"])) for r in rows if "eval/loss" in r)
    assert all(k in rows[0] for k in ("grad_norm", "learning_rate", "tokens_per_s", "tflops_per_s", "mfu"))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6", "8"]  # every 3 steps + final, keep 2
    for name in ("config.yaml", "run_info.json", "loss.png", "hf/config.json", "hf/tokenizer.json"):
        assert (tmp_path / name).exists(), name
    assert list((tmp_path / "tensorboard").iterdir())
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["param_count"] > 0 and "jax" in info["versions"] and info["memory_after_first_step"]
    # the run decodes straight from its checkpoint (recipes.decode on a run directory)
    from recipes.decode import main as decode

    assert (
        decode(
            [str(tmp_path), "--tokenizer", arithmetic_tokenizer, "--prompt", "Calculate 1 * 3.", "--max-tokens", "4"]
        )
        == 0
    )


def test_eval_on_start_evaluates_the_starting_model_at_step_0(tmp_path, arithmetic_tokenizer):
    cfg = config(tmp_path, "train.eval_on_start=true", "train.steps=4", "checkpoint.enabled=false")
    trainer(cfg, arithmetic_tokenizer).fit()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    assert sorted(evals) == [0, 4]
    assert evals[0] == pytest.approx(np.log(512), abs=0.5)  # a random model's: uniform over the vocabulary


def test_nan_abort_keeps_last_good_checkpoint(tmp_path, arithmetic_tokenizer):
    cfg = config(tmp_path, "checkpoint.every_steps=2")
    t = trainer(cfg, arithmetic_tokenizer, poisoned_loss, poison=True)
    with pytest.raises(NonFiniteLoss, match="step 3: loss nan.*Checkpoint .*/3 holds the parameters"):
        t.fit()
    # checkpoint 3 holds the state from before the bad update (== checkpoint 2), data positioned after it
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]
    after_abort, _ = t.trainer.checkpointer.restore(3, t.state, None, cfg)
    good, _ = t.trainer.checkpointer.restore(2, t.state, None, cfg)
    for a, b in zip(jax.tree.leaves(after_abort.params), jax.tree.leaves(good.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # resumed past the bad batch, the next step is 4, and a NaN there is named so (the checkpoint's policy version
    # is 2: the aborted update was not counted)
    always_nan = lambda m, b, r: LossOutput(nll_loss(m, b, r).total * jnp.nan, nll_loss(m, b, r).denominator)
    with pytest.raises(NonFiniteLoss, match="pretraining step 4: loss nan"):
        trainer(cfg, arithmetic_tokenizer, always_nan).fit()


def test_nan_skip_continues(tmp_path, arithmetic_tokenizer, capsys):
    cfg = config(tmp_path, "train.nan_policy=skip")
    loop = trainer(cfg, arithmetic_tokenizer, poisoned_loss, poison=True)
    assert loop.fit() == 8 and int(loop.state.step) == 8
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # a list of (step, skipped) as logged: a step logged twice, or one missing, is seen
    skipped = [(r["step"], r["skipped_steps"]) for r in rows if "skipped_steps" in r]
    assert skipped == [(s, float(s == 3)) for s in range(1, 9)]  # step 3 held the poisoned batch
    assert "step 3: loss nan, grad norm nan is not finite; the update was not applied" in capsys.readouterr().out


def test_sigterm_saves_and_resumes(tmp_path, arithmetic_tokenizer, capsys):
    cfg = config(tmp_path, "checkpoint.every_steps=100")

    def terminate_at_step_5(step, batch):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    assert trainer(cfg, arithmetic_tokenizer, on_batch=terminate_at_step_5).fit() == 5
    assert "SIGTERM: checkpoint saved at step 5" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["5"]
    loop = trainer(cfg, arithmetic_tokenizer)
    assert loop.fit() == 8 and int(loop.state.step) == 8
    assert "resumed from" in capsys.readouterr().out


def test_a_position_checkpoints_the_data_as_the_iterator_does(tmp_path, arithmetic_tokenizer):
    """A trainer in other processes checkpoints the run's data position as a value (`core.trainer.Position`, what
    `posttrain.trainer.TrainerHandle` sends): a checkpoint saved from a Position restores the run's Grain iterator to
    the batch after it, and one saved from the iterator itself restores into a Position holding its state."""
    from core.trainer import Position

    cfg = config(tmp_path, "data.shuffle=true")
    t = trainer(cfg, arithmetic_tokenizer)
    data = t.source.position
    for _ in range(3):
        next(data)
    t.trainer.save(3, {}, Position.of(data))
    t.trainer.wait()
    expected = next(data).example_ids

    fresh = trainer(config(tmp_path, "data.shuffle=true"), arithmetic_tokenizer)  # restores checkpoint 3
    assert fresh.start_step == 3
    np.testing.assert_array_equal(fresh.source.next().item.example_ids, expected)
    assert not np.array_equal(
        trainer(config(tmp_path / "new", "data.shuffle=true"), arithmetic_tokenizer).source.next().item.example_ids,
        expected,
    )

    t.trainer.save(4, {}, data)  # the iterator itself, one batch further
    t.trainer.wait()
    position = Position()
    assert t.trainer.restore_latest(position) is not None
    assert position.value == data.get_state()


def test_a_run_that_fails_to_build_closes_its_trainer(tmp_path, arithmetic_tokenizer, monkeypatch):
    """`build_run` closes the trainer it built (what its attach serves from, the checkpoint writer) when what comes
    after fails: a method's parts that raise leave nothing running."""
    from core.pretrain import Pretraining
    from core.run import build_run

    class BrokenParts(Pretraining):
        def parts(self, run):
            raise ValueError("the method's data is broken")

    closed = []
    monkeypatch.setattr(Trainer, "close", lambda self: closed.append(self))
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    cfg = config(tmp_path, f"data.source={source}", f"data.tokenizer_dir={arithmetic_tokenizer}")
    with pytest.raises(ValueError, match="the method's data is broken"):
        build_run(cfg, BrokenParts())
    assert len(closed) == 1 and isinstance(closed[0], Trainer)


def test_a_dataset_run_refuses_the_profiler_with_a_trainer_group(tmp_path):
    """The profiler traces the run's process, and a trainer group's steps run in its actors: refused at start,
    before Ray starts."""
    from core.config_loader import ConfigError
    from core.pretrain import PRETRAINING
    from posttrain.offline import fit_offline

    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps(RECORDS[0]) + "\n")
    cfg = config(tmp_path, "placement.trainer_processes=2", "profiler.enabled=true", f"data.source={source}")
    with pytest.raises(ConfigError, match="profile with placement.trainer_processes=1"):
        fit_offline(cfg, PRETRAINING)


def test_a_trainer_groups_apply_waits_as_long_as_its_caller_says(tmp_path):
    """`TrainerHandle.apply` sends `fn` to every process and waits `timeout_s` when given (a pass over a dataset,
    each of its batches within a call's timeout), else the group's `placement.call_timeout_s`; a trainer in this
    process runs `fn` on itself."""
    from posttrain.trainer import LocalTrainer, TrainerHandle

    class Group:
        lost = False

        def __init__(self):
            self.calls = []

        def call(self, method, *args, timeout_s=None):
            self.calls.append((method, args, timeout_s))
            return "process 0's answer"

    group = Group()
    handle = TrainerHandle(tmp_path, group=group)  # type: ignore[arg-type]
    fn = lambda trainer, x: x
    assert handle.apply(fn, 1, timeout_s=7200.0) == "process 0's answer"
    assert handle.apply(fn, 2) == "process 0's answer"
    assert group.calls == [(LocalTrainer.apply, (fn, 1), 7200.0), (LocalTrainer.apply, (fn, 2), None)]
    assert Trainer.apply(object(), fn, 3) == 3  # type: ignore[arg-type]
