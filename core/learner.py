"""One model's training state and its jitted update, for any loss in the `core.train` contract.

    learner = Learner(model, mesh, loss_fn, cfg.optim, total_updates=cfg.train.steps, seed=cfg.run.seed)
    metrics = learner.update(batch, micro_batches=2)   # one optimizer update on a host batch; floats
    loss_sum, sums = learner.evaluate(batch)           # the loss without an update (evaluation)
    learner.params, learner.state, learner.graphdef
    learner.save(checkpointer, cfg, data_iterator, extra); learner.restore_latest(checkpointer, cfg, data_iterator)
    learner.export_hf("run/hf", tokenizer_dir)

Every method trains through one: the offline methods in `core.loop.TrainLoop`, the on-policy ones inside their
policy learner (`posttrain.onpolicy.learner.PolicyLearner`), which adds the frozen models' and pi_old's passes
around it. Each batch shape is compiled once, ahead of time (`update` reports the first compilation's XLA memory
analysis in `last_compile`), and executed with the state donated. An update whose loss or gradient is not finite
is never applied (`core.train`); `apply_nan_policy` is what every loop then does about it (`train.nan_policy`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from core.checkpoint import Checkpointer
from core.config import Config, OptimConfig
from core.distributed import CompiledTogether, barrier
from core.errors import TemperError
from core.models import Decoder
from core.optim import make_optimizer, make_schedule
from core.train import (
    LossFn,
    bind_loss,
    init_train_state,
    jit_train_step,
    make_train_step,
    memory_analysis_line,
    place_batch,
    split_micro_batches,
)


class NonFiniteLoss(TemperError, FloatingPointError):
    """An update's loss or gradient was not finite under `train.nan_policy=abort` (the update was not applied)."""


def apply_nan_policy(metrics: dict[str, float], policy: str, where: str) -> bool:
    """What a loop does about an update (`Learner.update`'s metrics): True when it was applied or had nothing to
    apply; False when it was not finite and `policy` is `skip` (said on the console); `abort` raises
    `NonFiniteLoss` (the caller saves a checkpoint of the state without it first)."""
    if metrics["finite"]:
        return True
    what = (
        f"{where}: loss {metrics['loss']}, grad norm {metrics['grad_norm']} is not finite; the update was not applied"
    )
    if policy == "abort":
        raise NonFiniteLoss(what)
    print(f"{what} (train.nan_policy=skip)", flush=True)
    return False


class Learner:
    def __init__(
        self,
        model: Decoder,
        mesh: Mesh,
        loss_fn: LossFn,
        optim: OptimConfig,
        total_updates: int,
        seed: int = 0,
        tx: optax.GradientTransformation | None = None,
        frozen: nnx.Module | None = None,
        companion: nnx.Module | None = None,
    ):
        """`tx` replaces the optimizer `optim` describes (e.g. one that records gradients, in tests). `frozen`: a
        model the loss reads in every step and evaluation without training it (online distillation's teacher;
        the loss then takes it as a fourth argument, `core.train.LossFn`). `companion`: a module trained with the
        model but kept apart from it (a feature-distillation projection, placed on `mesh`; the loss takes it
        fifth): checkpointed in the state, never part of `model()`, `params` or the export."""
        self.mesh = mesh
        self.model_cfg = model.cfg
        self.schedule = make_schedule(optim, total_updates)
        companion_graphdef, companion_params = nnx.split(companion) if companion is not None else (None, None)
        with jax.set_mesh(mesh):
            self.tx = tx or make_optimizer(optim, total_updates, nnx.state(model), companion_params)
            self.graphdef, self.state = init_train_state(model, self.tx, seed, companion_params)
        frozen_graphdef: nnx.GraphDef | None = None
        self.frozen_params: nnx.State | None = None
        if frozen is not None:
            frozen_graphdef, self.frozen_params = nnx.split(frozen)
        step = make_train_step(self.graphdef, loss_fn, self.tx, self.schedule, frozen_graphdef, companion_graphdef)
        self._step = jit_train_step(step, self.state)
        self._executables: dict[Any, Callable] = {}
        bound = bind_loss(self.graphdef, loss_fn, frozen_graphdef, companion_graphdef)
        self._evaluate = CompiledTogether(
            jax.jit(lambda trainable, batch, frozen: bound(trainable, batch, jax.random.key(0), frozen)), "evaluation"
        )
        self.last_compile: str | None = None  # XLA's memory analysis of the latest newly compiled shape

    @property
    def params(self) -> nnx.State:
        return self.state.params

    def model(self) -> Decoder:
        """The current parameters as a model (for generation, export)."""
        return nnx.merge(self.graphdef, self.state.params)

    # ------------------------------------------------------------------ train

    def update(self, batch: Any, micro_batches: int = 1) -> dict[str, float]:
        """One optimizer update on a host batch (any pytree of `[N, ...]` arrays), accumulated over
        `micro_batches`; the step's metrics as floats (`finite`, `empty` say whether it was applied)."""
        placed = place_batch(split_micro_batches(batch, micro_batches, self.mesh), self.mesh)
        with jax.set_mesh(self.mesh):  # activation sharding constraints apply under the mesh
            self.state, metrics = self._executable(placed)(self.state, placed, self.frozen_params)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def compile(self, batch: Any, micro_batches: int = 1) -> str:
        """Compile the update for this batch's shapes now (not inside a timed step); XLA's memory analysis."""
        self._executable(place_batch(split_micro_batches(batch, micro_batches, self.mesh), self.mesh))
        return self.last_compile or ""

    @property
    def compiled_shapes(self) -> int:
        """How many batch shapes the update has been compiled for."""
        return len(self._executables)

    def _executable(self, placed: Any) -> Callable:
        leaves, treedef = jax.tree.flatten(placed)  # the treedef holds static fields (PackedBatch.scored)
        key = (treedef, tuple((x.shape, str(x.dtype)) for x in leaves))
        if key not in self._executables:
            with jax.set_mesh(self.mesh):
                compiled = self._step.lower(self.state, placed, self.frozen_params).compile()
            self.last_compile = memory_analysis_line(compiled)
            self._executables[key] = compiled
            barrier("a newly compiled update")  # a process group's collectives start together (core.distributed)
        return self._executables[key]

    def evaluate(self, batch: Any) -> tuple[float, dict[str, float]]:
        """(loss sum, other sums) of one host batch under the current parameters, no update."""
        placed = place_batch(split_micro_batches(batch, 1, self.mesh), self.mesh)
        with jax.set_mesh(self.mesh):
            first = jax.tree.map(lambda x: x[0], placed)
            loss_sum, sums = self._evaluate(self.state.trainable, first, self.frozen_params)
        return float(loss_sum), {k: float(v) for k, v in jax.device_get(sums).items()}

    # ------------------------------------------------------------ checkpoints

    def save(
        self,
        checkpointer: Checkpointer,
        cfg: Config,
        data_iterator: Any | None = None,
        extra: dict | None = None,
        step: int | None = None,
    ) -> int:
        return checkpointer.save(self.state, data_iterator, cfg, extra, step=step)

    def restore_latest(
        self, checkpointer: Checkpointer, cfg: Config, data_iterator: Any | None = None
    ) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (a corrupt one is moved aside), or None."""
        with jax.set_mesh(self.mesh):
            restored = checkpointer.restore_latest(self.state, data_iterator, cfg)
        if restored is None:
            return None
        self.state, meta, step = restored
        return step, meta

    def export_hf(self, path: str | Path, tokenizer_dir: str | None) -> Path:
        from core.hf import save_hf

        return save_hf(self.model(), self.model_cfg, path, tokenizer_dir=tokenizer_dir)
