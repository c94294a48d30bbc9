"""One module tree's training state and its jitted update, for any loss in the `core.train` contract.

    learner = Learner(model, mesh, loss_fn, cfg.optim, total_updates=cfg.train.steps, seed=cfg.run.seed)
    update = learner.update(batch, micro_batches=2)   # one optimizer update on a host batch: a core.train.Update
    out = learner.evaluate(batch)                      # the loss without an update: a core.train.LossOutput
    learner.model()                                    # the trained model (a Decoder), for sampling and export
    learner.save(checkpointer, cfg, data_iterator, extra); learner.restore_latest(checkpointer, cfg, data_iterator)

What a learner trains is the method's module tree (a `Decoder`, or a module holding the trained `Decoder` as
`.model` beside what its loss also reads: modules trained with it, frozen models) cut by a filter (`trainable`, Flax
NNX: `nnx.Param` by default, `nnx.LoRAParam` for a model with LoRA adapters): the selected parameters get gradients,
optimizer moments and checkpoints; the rest is frozen state, passed to the step as it is. Every method trains
through one, inside its trainer (`core.method_learner.MethodLearner`), which the dataset loop
(`core.train_loop.TrainLoop`) and the on-policy trainer both host. Each batch shape is compiled once, ahead of time
(`update` reports the first compilation's XLA memory analysis in `last_compile`), and executed with the state
donated. An update whose loss or gradient is not finite is never applied (`core.train`); `apply_nan_policy` is what
every loop then does about it (`train.nan_policy`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from core.checkpoint import Checkpointer
from core.compile_cache import BACKGROUND_PREFIX
from core.config import Config, OptimConfig
from core.distributed import CompiledTogether, any_process, barrier
from core.errors import TemperError
from core.models import Decoder, ModuleTree, trained_model, trained_model_path
from core.models.lora import trainable_filter
from core.optim import make_optimizer, make_schedule, trainable_paths
from core.shape_plan import ShapePlan
from core.sums import to_host
from core.train import (
    LossFn,
    LossOutput,
    Update,
    batch_sharding,
    batch_shards,
    bind_loss,
    check_packing_groups,
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
        compile_ahead: bool = False,
        optimizer: Callable[[nnx.State], optax.GradientTransformation] | None = None,
    ):
        """`modules`: the method's module tree (on `mesh`); `trainable`: the filter of what trains (None: the
        trained model's own, `core.models.lora.trainable_filter`: every parameter, or its LoRA adapters). `tx`
        replaces the optimizer `optim` describes (e.g. one that records gradients, in tests); `optimizer(params)`
        builds it over the trainable state instead (a method whose parts each have their own). `compile_ahead`:
        compile the shapes a run is likely to need next in a background thread (`core.shape_plan`,
        `compile.ahead`)."""
        self.mesh = mesh
        self.model_cfg = trained_model(modules).cfg
        base = trainable_filter(self.model_cfg) if trainable is None else trainable
        self.trainable = trainable_paths(base, optim.trainable_regex)
        self.schedule = make_schedule(optim, total_updates)
        if optim.trainable_regex is not None and not jax.tree.leaves(nnx.state(modules, self.trainable)):
            raise ValueError(f"optim.trainable_regex {optim.trainable_regex!r} matches no parameter")
        self.graphdef, params, self.rest = split_modules(modules, self.trainable)
        with jax.set_mesh(mesh):
            if tx is None:
                tx = optimizer(params) if optimizer is not None else make_optimizer(optim, total_updates, params)
            self.tx = tx
            self.state = init_train_state(params, self.tx, seed)
        self._step = jit_train_step(make_train_step(self.graphdef, loss_fn, self.tx, self.schedule), self.state)
        self._executables: dict[Any, Callable] = {}
        self._compiling = threading.Lock()  # the executables, written from the plan's background thread too
        # The shapes the update runs in: rows, targets scored and positions compacted per batch (core.shape_plan).
        self.plan = ShapePlan(
            self._compile_host,
            dict(mesh.shape),
            batch_shards(mesh),
            ahead=compile_ahead,
            agree=lambda flag: not any_process(not flag),
        )
        bound = bind_loss(self.graphdef, loss_fn, router_terms=False)
        self._evaluate = CompiledTogether(
            jax.jit(lambda params, rest, batch: bound(params, rest, batch, None)),
            "evaluation",  # no dropout
        )
        self.last_compile: str | None = None  # XLA's memory analysis of the latest newly compiled shape
        self._state_shapes: Any = None
        # Where the trained model sits in the tree: the tree itself, or its `.model` (what a checkpoint records).
        self.model_path: list[str] = trained_model_path(modules)
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
        check_packing_groups(batch, micro_batches)
        _, shaped = self.plan.shape(batch)
        placed = place_batch(split_micro_batches(shaped, micro_batches, self.mesh, set_counts=False), self.mesh)
        with jax.set_mesh(self.mesh):  # activation sharding constraints apply under the mesh
            self.state, report = self._executables[_key(placed)](self.state, placed, self.rest)
        return to_host(jax.device_get(report))

    def compile(self, batch: Any, micro_batches: int = 1) -> str:
        """Compile the update for the shape this batch runs in now (not inside a timed step); XLA's memory
        analysis."""
        check_packing_groups(batch, micro_batches)
        self.plan.shape(batch)
        return self.last_compile or ""

    @property
    def compiled_shapes(self) -> int:
        """How many batch shapes the update has been compiled for (ahead of need included)."""
        with self._compiling:
            return len(self._executables)

    def _compile_host(self, batch: Any) -> None:
        """Compile the update for a host batch laid out in its shape (`core.shape_plan.apply`), from its shapes alone;
        on the plan's background thread too, where nothing waits for it (and no process waits for the others)."""
        micro = split_micro_batches(batch, batch.packed.groups, set_counts=False)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding(self.mesh, x.shape)), micro
        )
        key = _key(abstract)
        with self._compiling:
            found = key in self._executables
        if not found:
            with jax.set_mesh(self.mesh):
                compiled = self._step.lower(self.state_shapes, abstract, self.rest).compile()
            with self._compiling:
                self._executables[key] = compiled
                self.last_compile = memory_analysis_line(compiled)
        # Found or compiled, a foreground call meets the group at the barrier (where a compilation ahead failed on
        # one process only, the others find the program compiled and wait here for that one).
        if not threading.current_thread().name.startswith(BACKGROUND_PREFIX):
            barrier("a newly compiled update")  # a process group's collectives start together (core.distributed)

    @property
    def state_shapes(self) -> Any:
        """The train state's shapes, dtypes and shardings (what compiling the update needs of it)."""
        if self._state_shapes is None:
            self._state_shapes = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state
            )
        return self._state_shapes

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
        model sits in the tree (`core.checkpoint_models.TRAINED_MODEL`) and what the frozen part was
        (`core.checkpoint_models.FROZEN`: the state it does not hold)."""
        from core.checkpoint_models import FROZEN, TRAINED_MODEL

        meta = {**(extra or {}), TRAINED_MODEL: self.model_path, FROZEN: self.frozen_record()}
        return checkpointer.save(self.state, data_iterator, cfg, meta, step=step)

    def frozen_record(self) -> dict[str, list[float]]:
        """`core.checkpoint_models.frozen_fingerprint` of the frozen state, computed once (it never changes)."""
        from core.checkpoint_models import frozen_fingerprint

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
        from core.checkpoint_models import FROZEN, check_frozen

        state, meta, step = restored
        check_frozen(meta.get(FROZEN), self.frozen_record(), f"{checkpointer.directory}/{step}")
        self.state = state
        self._state_shapes = None  # read again from the restored state (its shardings are the checkpoint's layout)
        return step, meta

    def export_hf(self, path: str | Path, tokenizer_dir: str | None, init_from: str | None = None) -> Path:
        """The trained model as a Hugging Face directory at `path`; a model with LoRA adapters has them merged into
        its weights there, and written alone, in PEFT's format, to `path`/adapter (`core.hf.peft`), naming as its
        base the model the run started from (`init_from`, or the base of the adapter it names)."""
        from core.hf.directory import save_hf
        from core.hf.peft import adapter_base, save_adapter

        model = self.model()
        out = save_hf(model, self.model_cfg, path, tokenizer_dir=tokenizer_dir)
        if self.model_cfg.lora is not None:
            save_adapter(model, Path(out) / ADAPTER_DIR, adapter_base(init_from))
        return out


def _key(batch: Any) -> Any:
    """What an executable of the update is compiled for: the batch's tree (static fields included) and shapes."""
    leaves, treedef = jax.tree.flatten(batch)  # the treedef holds static fields (PackedBatch.scored)
    return (treedef, tuple((x.shape, str(x.dtype)) for x in leaves))
