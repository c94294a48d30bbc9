"""A method's learner, as a trainer hosts it: built from the method, one step at a time, checkpointed, exported.

    learner = MethodLearner(cfg, GRPO, model, mesh)      # the method's tree, filter and loss on a core.learner.Learner
    stats = learner.train(batch)                        # attach -> the method's updates -> its TrainStats
    learner.save(checkpointer, step, extra)             # the state, the policy version and `extra`

What every method shares once it has a batch, whatever the batch came from: the `core.learner.Learner` on the
method's module tree (`Method.modules`), trainable filter (`Method.trainable`) and loss, its schedule over
`train.steps` x `Method.updates_per_step`; what `Method.attach` puts on each batch (frozen models' values); the
method's updates, each under `train.nan_policy` (`core.learner.apply_nan_policy`: `abort` raises `NonFiniteLoss`
before the next update, `skip` counts it); the policy version (steps trained: what samplers tag their completions
with); checkpoints that restore it; the Hugging Face export.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optax
from jax.sharding import Mesh

from core.checkpoint import Checkpointer
from core.learner import Learner, apply_nan_policy
from core.method import Method, Served, TrainStats
from core.train import LossOutput, Update, batch_shards

POLICY_VERSION = "policy_version"  # the checkpoint meta's key


def build_learner(
    cfg: Any,
    method: Method,
    model: Any,
    mesh: Mesh,
    tx: optax.GradientTransformation | None = None,
    compile_ahead: bool | None = None,
) -> Learner:
    """The `Learner` of `method` on `model`: its module tree, loss, trainable filter and optimizer, the schedule
    over `train.steps` x `Method.updates_per_step` (every run kind builds it here). `compile_ahead`: None reads
    `compile.ahead`."""
    total = cfg.train.steps * method.updates_per_step(cfg)
    return Learner(
        method.modules(cfg, model, mesh),
        mesh,
        method.loss(cfg),
        cfg.optim,
        total_updates=total,
        seed=cfg.run.seed,
        tx=tx,
        trainable=method.trainable(cfg),
        compile_ahead=cfg.compile.ahead if compile_ahead is None else compile_ahead,
        optimizer=lambda params: method.optimizer(cfg, total, params),
    )


class MethodLearner:
    """The method's `Learner`, its attached values and its step (module docstring)."""

    def __init__(
        self,
        cfg: Any,
        method: Method,
        model: Any,
        mesh: Mesh,
        tx: optax.GradientTransformation | None = None,
    ):
        """`model`: the initial model on `mesh` (`core.checkpoint_models.initial_model`); `tx` replaces the
        optimizer `cfg.optim` describes (e.g. one that records gradients, in tests)."""
        self.cfg, self.method, self.mesh = cfg, method, mesh
        self.learner = build_learner(cfg, method, model, mesh, tx)
        self.attach = method.attach(cfg, self.learner)
        self.version = 0  # steps trained (what samplers tag their completions with)
        self.skipped_updates = 0  # non-finite loss or gradient (train.nan_policy=skip)
        self.empty_updates = 0  # updates with nothing to learn from: no optimizer step

    def model(self):
        """The trained model as it is now (a `core.models.Decoder`; no copy)."""
        return self.learner.model()

    def batch_shards(self) -> int:
        """The data-parallel size: packed row counts are made a multiple of it."""
        return batch_shards(self.mesh)

    def train(self, batch: Any, step: int | None = None) -> TrainStats:
        """One step on `batch`: the attached values, the method's updates, its report (with the update counts and
        the time the updates took). `step`: the run's step, which a NaN message names (default: the policy
        version's next; a dataset run's step and version part after an aborted update is resumed)."""
        start = time.perf_counter()
        batch, attached = self.attach(batch)
        collected: list[Update] = []
        for update, where in self.method.updates(self.cfg, self.learner, batch):
            at = f"{self.method.name} step {self.version + 1 if step is None else step}" + (
                f", {where}" if where else ""
            )
            if not apply_nan_policy(update, self.cfg.train.nan_policy, at):
                self.skipped_updates += 1
            self.empty_updates += int(update.empty)
            collected.append(update)
        self.version += 1
        stats = self.method.report(self.cfg, collected, attached)
        counts = {
            "skipped_updates": float(self.skipped_updates),
            "empty_updates": float(self.empty_updates),
            "time/update_s": time.perf_counter() - start,
        }
        return TrainStats({**stats.metrics, **counts}, stats.line)

    def close(self) -> None:
        """Stop what the method's attach serves its values from (`core.method.Served`), if anything."""
        if isinstance(self.attach, Served):
            self.attach.close()

    def evaluate(self, batch: Any) -> LossOutput:
        """The loss's output on a held-out batch (one packing group) with the attached values, no update."""
        return self.learner.evaluate(self.attach(batch)[0])

    # ------------------------------------------------------------ checkpoints

    def save(self, checkpointer: Checkpointer, step: int, extra: dict, data_iterator: Any = None) -> None:
        """A checkpoint at `step` of the state, the policy version, `extra` and a dataset's position
        (`data_iterator`: `core.batch_source.DatasetSource.position`)."""
        meta = {**extra, POLICY_VERSION: self.version}
        self.learner.save(checkpointer, self.cfg, data_iterator, extra=meta, step=step)

    def restore_latest(self, checkpointer: Checkpointer, data_iterator: Any = None) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (a corrupt one is moved aside), or None; the
        dataset's position into `data_iterator`."""
        restored = self.learner.restore_latest(checkpointer, self.cfg, data_iterator)
        if restored is not None:
            step, meta = restored
            # A dataset run's checkpoint from before the one trainer has no version: it trained one per step.
            self.version = int(meta.get(POLICY_VERSION, step))
        return restored

    def export_hf(self, path: str | Path, tokenizer_dir: str | None) -> Path:
        """The trained model alone, as a Hugging Face directory (what a sampler starts from)."""
        return self.learner.export_hf(path, tokenizer_dir, self.cfg.checkpoint.init_from)

    def export(self, path: str | Path, tokenizer_dir: str | None) -> Path:
        """The run's export: the trained model at `path`, and what the method exports beside it."""
        out = self.export_hf(path, tokenizer_dir)
        self.method.export_beside(self.cfg, self.learner, Path(out), tokenizer_dir)
        return out
