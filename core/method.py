"""The one contract every method writes: what it checks, what trains and how one batch becomes updates.

    class MyMethod(Method[MyBatch]):
        name = "my method"
        def loss(self, cfg): ...                        # the core.train contract: (modules, batch, key) -> LossOutput
        def attach(self, cfg, learner): ...             # frozen models' values put on a batch (default: none)
        def updates(self, cfg, learner, batch): ...     # one batch -> its optimizer updates (default: one)

A method is one object, the same in the driver and in every trainer process (it holds no run's state: what a run
builds it builds from `cfg`). It says

- what it can run: `check` (the config, before anything starts), `check_tokenizer` (against the run's tokenizer,
  before the model loads), `tokenizer_texts` (what a tokenizer is trained on when the run has none);
- what trains, where the trainer is (`core.method_learner.MethodLearner` builds it, once, for every method):
  `modules` (the module tree: the model, or a `core.models.ModuleTree` holding it beside modules trained with it
  and frozen models), `trainable` (a Flax NNX filter: every parameter of the model, or its LoRA adapters),
  `loss`, `updates_per_step` (how many optimizer updates a step makes: the schedule counts them);
- how a batch trains: `attach` builds, once beside the learner, what puts frozen models' values on a batch (their
  log-probs, values made from them) with the metrics they give; `updates` turns one batch into its
  optimizer updates (GRPO's iterations x mini-batches; by default one, accumulated over `train.micro_batches`);
  `report` makes the step's typed `TrainStats` from them;
- where its batches come from: a dataset (`parts`, `core.run.build_run`) or the samplers (`posttrain.onpolicy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import optax
from flax import nnx
from jax.sharding import Mesh

from core.compile_cache import CompileTally
from core.config_loader import ConfigError
from core.models import Decoder, ModuleTree
from core.models.lora import trainable_filter
from core.optim import make_optimizer
from core.train import LossFn, Update

if TYPE_CHECKING:
    from core.learner import Learner
    from core.run import MethodParts, RunContext

B = TypeVar("B")

# A batch -> the batch with frozen models' values on it, and the metrics they give (built by `Method.attach`).
Attach = Callable[[B], tuple[B, dict[str, float]]]


@dataclass(frozen=True)
class TrainStats:
    """What one step reports (it crosses to the driver from a trainer actor): its metrics by the names they are
    logged under, and the method's part of the console line, written where the metrics are made so that no other
    file reads them back by name."""

    metrics: dict[str, float]
    line: str = ""
    # What the step compiled in the trainer's process, and the time it waited for it (set by the trainer).
    compile: CompileTally = field(default_factory=CompileTally)


def unchanged(batch: Any) -> tuple[Any, dict[str, float]]:
    return batch, {}


@dataclass(frozen=True)
class Served(Generic[B]):
    """An `Attach` that owns what serves its values (a frozen model in a Ray actor of its own): the trainer calls
    `close` when the run ends, however it ends."""

    attach: Attach[B]
    close: Callable[[], None]

    def __call__(self, batch: B) -> tuple[B, dict[str, float]]:
        return self.attach(batch)


class Method(Generic[B]):
    """A method: override what is its own (module docstring). `B`: the batch its loss reads."""

    name: str = "a method"  # what the run calls it ("SFT", "GRPO")

    # ------------------------------------------------------------------ the config

    def check(self, cfg: Any) -> None:
        """Raise `ConfigError` for a config this method cannot run (before anything is loaded)."""

    def check_tokenizer(self, cfg: Any, tokenizer: Any) -> None:
        """Raise `ConfigError` for a config the run's tokenizer rules out (a top-k above its vocabulary), before
        the model loads."""

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]:
        """The text a tokenizer is trained on when the run has none: every string field of the rows."""
        return (v for r in records for v in r.values() if isinstance(v, str))

    # ------------------------------------------------------------------ what trains

    def modules(self, cfg: Any, model: Any, mesh: Mesh) -> Decoder | ModuleTree:
        """The module tree the method trains (`core.train`): the model itself, or a `core.models.ModuleTree`
        holding it as `.model` beside what its loss also reads (modules trained with it, frozen models), on
        `mesh`."""
        return model

    def trainable(self, cfg: Any) -> Any:
        """What trains in `modules` (a Flax NNX filter): every parameter of the model, or its LoRA adapters."""
        return trainable_filter(cfg.model)

    def loss(self, cfg: Any) -> LossFn:
        raise NotImplementedError(f"{self.name} has no loss")

    def updates_per_step(self, cfg: Any) -> int:
        """Optimizer updates a step makes (the learning-rate schedule runs over `train.steps` times this)."""
        return 1

    def optimizer(self, cfg: Any, total_updates: int, params: nnx.State) -> optax.GradientTransformation:
        """The optimizer over the trainable state `params`: `optim.*`'s; a method whose trainable parts each have
        their own (a learning rate or a start of its own per part) builds it here."""
        return make_optimizer(cfg.optim, total_updates, params)

    # ------------------------------------------------------------------ how a batch trains

    def attach(self, cfg: Any, learner: Learner) -> Attach[B]:
        """What puts frozen models' values on a batch before its updates, built once beside `learner` (it loads
        or copies the frozen models it needs); by default nothing."""
        return unchanged

    def updates(self, cfg: Any, learner: Learner, batch: B) -> Iterator[tuple[Update, str]]:
        """The step's optimizer updates on `batch`, each with where it is in the step (for the NaN message): by
        default one, accumulated over `train.micro_batches`. A generator: an update that must stop the run stops
        it before the next one."""
        yield learner.update(batch, cfg.train.micro_batches), ""

    def report(self, cfg: Any, updates: list[Update], attached: dict[str, float]) -> TrainStats:
        """The step's metrics from its updates and what `attach` measured; by default the last update's."""
        return TrainStats({**updates[-1].metrics(), **attached})

    def export_beside(self, cfg: Any, learner: Learner, hf_dir: Path, tokenizer_dir: str | None) -> None:
        """What the run's end exports beside the trained model's Hugging Face directory `hf_dir` (another trained
        module of its tree, in a directory of its own); by default nothing."""

    # ------------------------------------------------------------------ a dataset's batches (offline methods)

    def parts(self, run: RunContext) -> MethodParts:
        raise NotImplementedError(f"{self.name} trains on batches from the samplers, not from a dataset")

    def example_batch(self, cfg: Any, row_multiple: int) -> Any:
        """A training batch of the configured shapes (full rows; a row count divisible by `row_multiple`, the
        data-parallel size) from the method's own batch builder: what `core.compile_only` compiles the update
        for."""
        raise ConfigError(f"train.compile_only is not offered for {self.name}")
