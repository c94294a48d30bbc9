"""What every on-policy method's learner shares: the policy `core.learner.Learner`, its policy version, the
non-finite-update policy (`core.learner.apply_nan_policy`, as the offline loop's), checkpoints and export. The
on-policy run's trainer (`posttrain.trainer`) hosts one.

    class PolicyGradientLearner(PolicyLearner): ...   # posttrain.onpolicy.policy_gradient: RLBatch (GRPO)
    class OnlineDPOLearner(PolicyLearner): ...        # posttrain.dpo.online: PairBatch, preference loss

A subclass builds `self.learner` (and any frozen model) and implements `train(batch) -> TrainStats`, calling
`self._applied(metrics, where)` after each optimizer update and `self.version += 1` once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from jax.sharding import Mesh

from core.batch import TrainBatch
from core.checkpoint import Checkpointer
from core.compile_cache import CompileTally
from core.learner import Learner, apply_nan_policy
from core.train import Update, batch_shards
from posttrain.config import PostTrainConfig

B = TypeVar("B", bound=TrainBatch)


@dataclass(frozen=True)
class TrainStats:
    """What one on-policy training step reports to the run (it crosses to the driver from the trainer actor): its
    metrics by the names they are logged under, and the method's part of the console line, written where the
    metrics are made so that no other file reads them back by name."""

    metrics: dict[str, float]
    line: str = ""
    # What the step compiled in the trainer's process, and the time it waited for it (set by the trainer).
    compile: CompileTally = field(default_factory=CompileTally)


class PolicyLearner(Generic[B]):
    """The shared part; `LearnerFactory` is how a trainer builds a method's subclass. `B`: the method's batch."""

    learner: Learner

    def __init__(self, cfg: PostTrainConfig, mesh: Mesh):
        self.cfg = cfg
        self.mesh = mesh
        self.version = 0  # policy updates so far (what samplers tag their completions with)
        self.skipped_updates = 0  # non-finite loss or gradient (train.nan_policy=skip)
        self.empty_updates = 0  # updates with nothing to learn from: no optimizer step

    def train(self, batch: B) -> TrainStats:  # pragma: no cover - every method has its own
        raise NotImplementedError

    def model(self):
        """The policy as it is now (a `core.models.Decoder`; no copy)."""
        return self.learner.model()

    def batch_shards(self) -> int:
        """The trainer's data-parallel size: packed row counts are made a multiple of it."""
        return batch_shards(self.mesh)

    def _applied(self, update: Update, where: str) -> None:
        """Account for one update: under `train.nan_policy=abort` a non-finite one raises (it was not applied:
        `core.train` left parameters and optimizer state as they were), else it is counted as skipped."""
        if not apply_nan_policy(update, self.cfg.train.nan_policy, where):
            self.skipped_updates += 1
        self.empty_updates += int(update.empty)

    # ------------------------------------------------------------ checkpoints

    def save(self, checkpointer: Checkpointer, step: int, extra: dict) -> None:
        self.learner.save(checkpointer, self.cfg, extra={**extra, "policy_version": self.version}, step=step)

    def restore_latest(self, checkpointer: Checkpointer) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (a corrupt one is moved aside), or None."""
        restored = self.learner.restore_latest(checkpointer, self.cfg)
        if restored is not None:
            self.version = int(restored[1]["policy_version"])
        return restored

    def export_hf(self, path: str | Path, tokenizer_dir: str | None) -> Path:
        return self.learner.export_hf(path, tokenizer_dir, self.cfg.checkpoint.init_from)


# (cfg, model, mesh, total_steps) -> a method's learner: the subclass itself (PolicyGradientLearner, OnlineDPOLearner)
LearnerFactory = Callable[[PostTrainConfig, Any, Mesh, int], PolicyLearner[Any]]
