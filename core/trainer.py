"""A method's trainer as one process hosts it: the learner, its checkpoints, the export, and the calls a run makes.

    trainer = Trainer(cfg, SFT, model, mesh, run_dir)     # a core.method_learner.MethodLearner + a Checkpointer
    stats = trainer.train(batch, step)                   # attach -> the method's updates -> its report
    trainer.save(step, extra, data_iterator)             # state, policy version, `extra`, the data's position
    store = trainer.apply(fn, *args)                     # fn(trainer, *args): a method's own work on the model

Every run talks to its trainer through these calls alone, whether the trainer is this object in the run's own
process or one such object in each process of a JAX process group of Ray actors (`posttrain.trainer.TrainerHandle`:
the same calls, each sent to every process, process 0's answer). So there is one topology: the run (its batch
source, loop, metrics and hooks) in the driver; the model only where the trainer is.

`apply` is how a method works on the trained model from the run's side (a frozen copy's values stored before the
first step, generations at an evaluation): its function runs where the model is, on every process of a
group (the same program in the same order), and what process 0 computed comes back. What it builds once and uses
again (a sampler) it keeps in `kept`, by a name of its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jax.sharding import Mesh

from core.checkpoint import Checkpointer
from core.compile_cache import CompileTally, compile_clock
from core.method import Method, TrainStats
from core.method_learner import MethodLearner
from core.metrics import device_memory, peak_flops_per_device
from core.models import param_count
from core.train import LossOutput, batch_shards


@dataclass(frozen=True)
class TrainerFacts:
    """What a run reads of its trainer once: the model's size and the devices it trains on."""

    param_count: int
    devices: int
    device_kind: str
    mesh: dict[str, int]
    batch_shards: int  # the data-parallel size: packed row counts are made a multiple of it
    model: dict  # the model section the trainer built (a checkpoint's shape wins over the config's)
    peak_flops: float  # per device, where the trainer runs (`core.metrics.peak_flops_per_device`)
    peak_source: str  # configured, a datasheet's, or measured there


class Position:
    """A data iterator's position as a value: what a trainer in another process checkpoints for the run's
    iterator (Grain's checkpoint handler calls `get_state` / `set_state` on it, as on the iterator itself)."""

    def __init__(self, state: Any = None):
        self.value = state  # the iterator's `get_state()`: a JSON-able dict

    @classmethod
    def of(cls, iterator: Any) -> Position:
        return cls(iterator.get_state())

    def get_state(self) -> bytes:
        return json.dumps(self.value, indent=4).encode()

    def set_state(self, state: bytes) -> None:
        self.value = json.loads(state)

    def start_prefetch(self) -> None:
        """Grain's handler starts an iterator's prefetch after a restore; a value has none."""


def initial_state(cfg: Any, devices: Sequence[Any] | None = None) -> tuple[Mesh, Any, Any]:
    """(mesh, model, config) a trainer starts from, on `devices` (default: this process's view of all): the mesh of
    `mesh.*` (a bad shape refused with the sizes), the model from `checkpoint.init_from` (its shape wins over
    `model.*`, so the config comes back with the model section it has) or a random init."""
    import jax

    from core.checkpoint_models import initial_model
    from core.config import resolve_mesh_shape
    from core.config_loader import ConfigError
    from core.mesh import make_mesh
    from core.models.summary import parameter_summary

    devices = list(devices) if devices is not None else jax.devices()
    try:  # fail early, with the sizes, on a bad mesh
        resolve_mesh_shape(cfg.mesh, len(devices))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mesh = make_mesh(cfg.mesh, devices)
    model, cfg = initial_model(cfg, mesh)
    if cfg.mesh.debug_sharding:
        print(parameter_summary(model))
    return mesh, model, cfg


class TrainerCalls(Protocol):
    """What a run calls on its trainer: `Trainer`'s methods, here or through a handle on a process group."""

    @property
    def remote(self) -> bool:
        """Whether it runs in other processes (their compilations are counted there)."""

    @property
    def lost(self) -> bool:
        """Whether a call found a process of it gone (nothing is left to close or wait for)."""

    def facts(self) -> TrainerFacts: ...
    def device_memory(self) -> str: ...
    def version(self) -> int: ...
    def memory_analysis(self) -> str | None: ...
    def compiled(self) -> CompileTally: ...
    def train(self, batch: Any, step: int | None = None) -> TrainStats: ...
    def evaluate(self, batch: Any) -> LossOutput: ...
    def apply(self, fn: Any, *args: Any, timeout_s: float | None = None) -> Any: ...
    def save(self, step: int, extra: dict, data_iterator: Any = None) -> None: ...
    def restore_latest(self, data_iterator: Any = None) -> tuple[int, dict] | None: ...
    def latest_step(self) -> int | None: ...
    def wait(self) -> None: ...
    def export(self, path: str, tokenizer_dir: str | None) -> str: ...
    def close(self) -> None: ...


class Trainer:
    """The method's `MethodLearner` with its checkpoints and export (module docstring)."""

    remote = False  # this object is the trainer, in the run's process
    lost = False

    def __init__(self, cfg: Any, method: Method, model: Any, mesh: Mesh, run_dir: str | Path | None = None):
        """`model`: the initial model on `mesh` (`core.checkpoint_models.initial_model`); checkpoints go to
        `run_dir/checkpoints` when `checkpoint.enabled` (none without a `run_dir`)."""
        self._clock_start = compile_clock().read()
        self.cfg, self.mesh = cfg, mesh
        self.learner = MethodLearner(cfg, method, model, mesh)
        c = cfg.checkpoint
        self.checkpointer = None
        if run_dir is not None and c.enabled:
            self.checkpointer = Checkpointer(Path(run_dir) / "checkpoints", keep=c.keep, async_save=c.async_save)
        self.kept: dict[str, Any] = {}  # what `apply`'s functions build once and use again, by their own names
        self._facts: TrainerFacts | None = None

    def model(self):
        """The trained model as it is now (no copy)."""
        return self.learner.model()

    def facts(self) -> TrainerFacts:
        """What the run reads of this trainer once (the peak FLOP/s measured here, once)."""
        if self._facts is None:
            peak, source = peak_flops_per_device(self.cfg.logging)
            self._facts = TrainerFacts(
                param_count=param_count(self.model()),
                devices=int(self.mesh.devices.size),
                device_kind=self.mesh.devices.flat[0].device_kind,
                mesh=dict(self.mesh.shape),
                batch_shards=batch_shards(self.mesh),
                model=self.cfg.model.model_dump(mode="json"),
                peak_flops=peak,
                peak_source=source,
            )
        return self._facts

    def device_memory(self) -> str:
        """The memory in use on this trainer's devices (its process's: process 0's in a group)."""
        return device_memory()

    def version(self) -> int:
        return self.learner.version

    def batch_shards(self) -> int:
        return self.learner.batch_shards()

    def memory_analysis(self) -> str | None:
        """XLA's memory analysis of the update's newest program (compiled, or loaded from the cache)."""
        return self.learner.learner.last_compile

    def compiled(self) -> CompileTally:
        """What this trainer's process compiled since the trainer started (its start-up included)."""
        return compile_clock().read() - self._clock_start

    def train(self, batch: Any, step: int | None = None) -> TrainStats:
        """One step of the method on `batch` (`MethodLearner.train`), with what it compiled in this process."""
        before = compile_clock().read()
        stats = self.learner.train(batch, step)
        return dataclasses.replace(stats, compile=compile_clock().read() - before)

    def evaluate(self, batch: Any) -> LossOutput:
        return self.learner.evaluate(batch)

    def apply(self, fn: Any, *args: Any, timeout_s: float | None = None) -> Any:
        """`fn(self, *args)`: a method's own work on the model, where the model is (module docstring);
        `timeout_s` bounds it in a process group (`posttrain.trainer.TrainerHandle.apply`), not here."""
        return fn(self, *args)

    # ------------------------------------------------------------ checkpoints

    def _checkpointer(self) -> Checkpointer:
        if self.checkpointer is None:
            raise RuntimeError("checkpoint.enabled is false: this trainer keeps no checkpoints")
        return self.checkpointer

    def save(self, step: int, extra: dict, data_iterator: Any = None) -> None:
        """A checkpoint at `step`: the state, the policy version, `extra` and the data's position (a Grain iterator
        or a `Position`)."""
        self.learner.save(self._checkpointer(), step, extra, data_iterator)

    def restore_latest(self, data_iterator: Any = None) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (corrupt ones moved aside), or None; the data's
        position into `data_iterator`."""
        if self.checkpointer is None:
            return None
        return self.learner.restore_latest(self.checkpointer, data_iterator)

    def latest_step(self) -> int | None:
        return None if self.checkpointer is None else self.checkpointer.latest_step()

    def wait(self) -> None:
        """Until the checkpoints being written are on disk."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def export(self, path: str, tokenizer_dir: str | None) -> str:
        """The run's export: the trained model at `path` and what its method exports beside it."""
        self.wait()
        return str(self.learner.export(path, tokenizer_dir))

    def close(self) -> None:
        """Stop what the method serves its attached values from, and the checkpoints' writer."""
        self.learner.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
