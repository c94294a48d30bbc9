"""One module tree's training state and its jitted update, for any loss in the `core.train` contract.

    learner = Learner(model, mesh, loss_fn, cfg.optim, total_updates=cfg.train.steps, seed=cfg.run.seed)
    update = learner.update(batch, micro_batches=2)   # one optimizer update on a host batch: a core.train.Update
    out = learner.evaluate(batch)                      # the loss without an update: a core.train.LossOutput
    learner.model()                                    # the trained model (a Decoder), for sampling and export
    learner.save(checkpointer, cfg, data_iterator, extra); learner.restore_latest(checkpointer, cfg, data_iterator)

What a learner trains is the method's module tree (a `Decoder`, or a module holding the trained `Decoder` as
`.model` beside what its loss also reads: modules trained with it, frozen models) cut by a filter (`trainable`,
Flax NNX:
`nnx.Param` by default, `nnx.LoRAParam` for a model with LoRA adapters): the selected parameters get gradients,
optimizer moments and checkpoints; the rest is frozen state, passed to the step as it is. Every method trains
through one: the offline methods in `core.loop.TrainLoop`, the on-policy ones inside their policy learner
(`posttrain.onpolicy.learner.PolicyLearner`). Each batch shape is compiled once, ahead of time (`update`
reports the first compilation's XLA memory analysis in `last_compile`), and executed with the state donated. An
update whose loss or gradient is not finite is never applied (`core.train`); `apply_nan_policy` is what every
loop then does about it (`train.nan_policy`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from core.batch import CompiledCounts
from core.checkpoint import Checkpointer
from core.config import Config, OptimConfig
from core.distributed import CompiledTogether, barrier
from core.errors import TemperError
from core.models import Decoder, ModuleTree, trained_model
from core.models.lora import trainable_filter
from core.optim import make_optimizer, make_schedule
from core.sums import to_host
from core.train import (
    LossFn,
    LossOutput,
    Update,
    bind_loss,
    init_train_state,
    jit_train_step,
    make_train_step,
    memory_analysis_line,
    place_batch,
    split_micro_batches,
    split_modules,
)

ADAPTER_DIR = "adapter"  # where an export puts a LoRA model's PEFT adapter, inside its Hugging Face directory


class NonFiniteLoss(TemperError, FloatingPointError):
    """An update's loss or gradient was not finite under `train.nan_policy=abort` (the update was not applied)."""


def apply_nan_policy(update: Update, policy: str, where: str) -> bool:
    """What a loop does about an update (`Learner.update`'s result): True when it was applied or had nothing to
    apply; False when it was not finite and `policy` is `skip` (said on the console); `abort` raises
    `NonFiniteLoss` (the loop saves a checkpoint of the state without it first)."""
    if update.finite:
        return True
    what = f"{where}: loss {update.loss}, grad norm {update.grad_norm} is not finite; the update was not applied"
    if policy == "abort":
        raise NonFiniteLoss(what)
    print(f"{what} (train.nan_policy=skip)", flush=True)
    return False


class Learner:
    def __init__(
        self,
        modules: Decoder | ModuleTree,
        mesh: Mesh,
        loss_fn: LossFn,
        optim: OptimConfig,
        total_updates: int,
        seed: int = 0,
        tx: optax.GradientTransformation | None = None,
        trainable: Any = None,
    ):
        """`modules`: the method's module tree (on `mesh`); `trainable`: the filter of what trains (None: the
        trained model's own, `core.models.lora.trainable_filter`: every parameter, or its LoRA adapters). `tx`
        replaces the optimizer `optim` describes (e.g. one that records gradients, in tests)."""
        self.mesh = mesh
        self.model_cfg = trained_model(modules).cfg
        self.trainable = trainable_filter(self.model_cfg) if trainable is None else trainable
        self.schedule = make_schedule(optim, total_updates)
        self.graphdef, params, self.rest = split_modules(modules, self.trainable)
        with jax.set_mesh(mesh):
            self.tx = tx or make_optimizer(optim, total_updates, params)
            self.state = init_train_state(params, self.tx, seed)
        self._step = jit_train_step(make_train_step(self.graphdef, loss_fn, self.tx, self.schedule), self.state)
        self._executables: dict[Any, Callable] = {}
        self._counts = CompiledCounts()  # the batches' static counts the update was compiled for
        bound = bind_loss(self.graphdef, loss_fn, router_terms=False)
        self._evaluate = CompiledTogether(
            jax.jit(lambda params, rest, batch: bound(params, rest, batch, None)),
            "evaluation",  # no dropout
        )
        self.last_compile: str | None = None  # XLA's memory analysis of the latest newly compiled shape
        # Where the trained model sits in the tree: the tree itself, or its `.model` (what a checkpoint records).
        self.model_path: list[str] = [] if isinstance(modules, Decoder) else ["model"]
        self._frozen_record: dict[str, list[float]] | None = None

    @property
    def params(self) -> nnx.State:
        """The trainable state (what the optimizer updates and a checkpoint holds)."""
        return self.state.params

    def modules(self) -> Decoder | ModuleTree:
        """The method's module tree with the current parameters (no copy: a later update donates the trainable
        arrays)."""
        return nnx.merge(self.graphdef, self.state.params, self.rest)

    def model(self) -> Decoder:
        """The trained model with the current parameters (for generation, weight sync, export)."""
        return trained_model(self.modules())

    # ------------------------------------------------------------------ train

    def update(self, batch: Any, micro_batches: int = 1) -> Update:
        """One optimizer update on a host batch (any pytree of `[N, ...]` arrays packed for `micro_batches`
        packing groups), accumulated over `micro_batches`; its outcome as floats (`finite`, `empty` say whether
        it was applied)."""
        placed = place_batch(split_micro_batches(batch, micro_batches, self.mesh, self._counts), self.mesh)
        with jax.set_mesh(self.mesh):  # activation sharding constraints apply under the mesh
            self.state, report = self._executable(placed)(self.state, placed, self.rest)
        return to_host(jax.device_get(report))

    def compile(self, batch: Any, micro_batches: int = 1) -> str:
        """Compile the update for this batch's shapes now (not inside a timed step); XLA's memory analysis."""
        self._executable(place_batch(split_micro_batches(batch, micro_batches, self.mesh, self._counts), self.mesh))
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
                compiled = self._step.lower(self.state, placed, self.rest).compile()
            self.last_compile = memory_analysis_line(compiled)
            self._executables[key] = compiled
            barrier("a newly compiled update")  # a process group's collectives start together (core.distributed)
        return self._executables[key]

    def evaluate(self, batch: Any) -> LossOutput:
        """The loss output of one host batch (one packing group) under the current parameters, no update, as
        floats."""
        placed = place_batch(split_micro_batches(batch, 1, self.mesh), self.mesh)
        with jax.set_mesh(self.mesh):
            first = jax.tree.map(lambda x: x[0], placed)
            out = self._evaluate(self.state.params, self.rest, first)
        return to_host(jax.device_get(out))

    # ------------------------------------------------------------ checkpoints

    def save(
        self,
        checkpointer: Checkpointer,
        cfg: Config,
        data_iterator: Any | None = None,
        extra: dict | None = None,
        step: int | None = None,
    ) -> int:
        """A checkpoint of the trainable state (and the data position, `extra`); its meta records where the trained
        model sits in the tree (`core.checkpoint.TRAINED_MODEL`) and what the frozen part was
        (`core.checkpoint.FROZEN`: the state it does not hold)."""
        from core.checkpoint import FROZEN, TRAINED_MODEL

        meta = {**(extra or {}), TRAINED_MODEL: self.model_path, FROZEN: self.frozen_record()}
        return checkpointer.save(self.state, data_iterator, cfg, meta, step=step)

    def frozen_record(self) -> dict[str, list[float]]:
        """`core.checkpoint.frozen_fingerprint` of the frozen state, computed once (it never changes)."""
        from core.checkpoint import frozen_fingerprint

        if self._frozen_record is None:
            self._frozen_record = frozen_fingerprint(self.rest)
        return self._frozen_record

    def restore_latest(
        self, checkpointer: Checkpointer, cfg: Config, data_iterator: Any | None = None
    ) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (a corrupt one is moved aside), or None."""
        with jax.set_mesh(self.mesh):
            restored = checkpointer.restore_latest(self.state, data_iterator, cfg)
        if restored is None:
            return None
        from core.checkpoint import FROZEN, check_frozen

        state, meta, step = restored
        check_frozen(meta.get(FROZEN), self.frozen_record(), f"{checkpointer.directory}/{step}")
        self.state = state
        return step, meta

    def export_hf(self, path: str | Path, tokenizer_dir: str | None, init_from: str | None = None) -> Path:
        """The trained model as a Hugging Face directory at `path`; a model with LoRA adapters has them merged into
        its weights there, and written alone, in PEFT's format, to `path`/adapter (`core.peft`), naming as its
        base the model the run started from (`init_from`, or the base of the adapter it names)."""
        from core.hf import save_hf
        from core.peft import adapter_base, save_adapter

        model = self.model()
        out = save_hf(model, self.model_cfg, path, tokenizer_dir=tokenizer_dir)
        if self.model_cfg.lora is not None:
            save_adapter(model, Path(out) / ADAPTER_DIR, adapter_base(init_from))
        return out
