"""Where a run's batches come from: one batch per step, told of every update, with a position a checkpoint keeps.

    drawn = source.next()                        # Drawn: the batch the trainer trains on, the source's metrics
    metrics = source.after_update(trainer, metrics)  # after every step (its metrics): a weight sync if it trained
    meta, position = source.checkpoint()         # what the trainer's checkpoint keeps of where the source is
    start = source.restore(step, meta)           # after the trainer restored `position` in place: the step to resume at
    held_out = source.evaluate(trainer)          # `eval/...` metrics ({}: nothing to evaluate)

The one run (`core.train_loop.TrainLoop`) reads any `BatchSource`. Two kinds exist: a dataset's (`DatasetSource`,
here: the method's Grain pipeline, its `prepare` and its held-out loss) and the samplers'
(`posttrain.onpolicy.source.SamplerSource`: prompts, rollouts, rewards, the method's batch; a weight sync after each
update; pass@k on held-out prompts).

A dataset's source is the method's pipeline (training rows, shuffled per epoch and repeated: `core.data.epochs`) and
its `prepare`: what turns a pipeline item into the batch the loss reads, from data the run holds (values stored
before the run, gathered by example id). Values computed by frozen models belong to `core.method.Method.attach`,
beside the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.data import DataBatch
from core.loop import Plot
from core.sums import combine, means

# (a pipeline's item, the packing groups its rows form: train.micro_batches when training, 1 when evaluating)
# -> what the method's loss reads.
Prepare = Callable[[DataBatch, int], Any]

LOSS_PLOT = Plot(("loss", "eval/loss"), "loss.png", "loss")


def as_is(data: DataBatch, groups: int) -> Any:
    return data.batch


@dataclass
class Drawn:
    """One step's draw from a source: the batch the trainer trains on (None: nothing to learn from this step, no
    update), the source's own metrics for the step, its part of the console line, and the item it came from (a
    dataset's pipeline item, for whoever inspects it)."""

    batch: Any
    metrics: dict[str, float] = field(default_factory=dict)
    line: str = ""
    item: Any = None


class BatchSource(Protocol):
    """One batch per step, told of every update, with a position a checkpoint keeps (module docstring)."""

    console: dict[str, str]  # metric -> label: what the console line shows of the source's metrics
    plots: Sequence[Plot]  # the curves the run draws at its end

    @property
    def evaluates(self) -> bool: ...  # whether `evaluate` has anything to evaluate

    def next(self) -> Drawn: ...

    def after_update(self, trainer: Any, metrics: dict[str, float]) -> dict[str, float]: ...

    @property
    def lock(self) -> AbstractContextManager: ...  # held around the run's trainer calls (another thread may make some)

    @property
    def position(self) -> Any: ...  # what a trainer's restore sets in place (a Grain iterator), or None

    def checkpoint(self) -> tuple[dict, Any]: ...

    def restore(self, step: int, meta: dict) -> int: ...

    def evaluate(self, trainer: Any) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass
class Evaluation:
    """The held-out evaluation of a dataset method: one pass over `batches()`, each prepared as for training,
    the loss and every sum the loss reports as means over the split (`eval/loss`, `eval/<metric>`), plus what
    `derive` computes from those means (the perplexity of a next-token loss)."""

    batches: Callable[[], Iterable[DataBatch]]
    derive: Callable[[dict[str, float]], dict[str, float]] | None = None


class DatasetSource:
    """A dataset's batches (module docstring): `next()` is the pipeline's next item, prepared (`prepare`: what the
    loss reads of it); `evaluate` the held-out loss (`evaluation`)."""

    plots: Sequence[Plot] = (LOSS_PLOT,)

    def __init__(
        self,
        pipeline: Iterable[DataBatch],
        prepare: Prepare = as_is,
        micro_batches: int = 1,
        evaluation: Evaluation | None = None,
        console: dict[str, str] | None = None,
    ):
        """`console`: the method's own metrics the console line shows (key -> label)."""
        self.iterator = iter(pipeline)
        self._prepare = prepare
        self.micro_batches = micro_batches
        self.evaluation = evaluation
        self.console = dict(console or {})
        self.lock: AbstractContextManager = contextlib.nullcontext()  # one thread calls the trainer

    @property
    def evaluates(self) -> bool:
        return self.evaluation is not None

    def prepare(self, item: DataBatch, groups: int | None = None) -> Any:
        """What the loss reads of `item`, packed for `groups` (default: the training step's micro-batches)."""
        return self._prepare(item, self.micro_batches if groups is None else groups)

    def next(self) -> Drawn:
        item = next(self.iterator)
        return Drawn(self.prepare(item), item=item)

    def after_update(self, trainer: Any, metrics: dict[str, float]) -> dict[str, float]:
        """A dataset's rows do not depend on the weights."""
        return {}

    @property
    def position(self) -> Any:
        """The Grain iterator: what a checkpoint saves and restores (`core.checkpoint.Checkpointer`)."""
        return self.iterator

    def checkpoint(self) -> tuple[dict, Any]:
        return {}, self.iterator

    def restore(self, step: int, meta: dict) -> int:
        """The iterator was restored in place with the trainer's state: the run goes on after `step`."""
        return step

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """`eval/loss` and `eval/<metric>`: the loss's sums over the held-out split, each divided by the summed
        denominator (a mean per target token, per pair, ...), and what the method derives from them."""
        if self.evaluation is None:  # (`evaluates`)
            return {}
        total, denominator, sums = 0.0, 0.0, None
        for data in self.evaluation.batches():
            out = trainer.evaluate(self.prepare(data, 1))
            total += out.total
            denominator += out.denominator
            sums = out.sums if sums is None else combine(sums, out.sums)
        values = {"loss": total / max(denominator, 1.0), **(means(sums, denominator) if sums is not None else {})}
        if self.evaluation.derive is not None:
            values.update(self.evaluation.derive(values))
        return {f"eval/{k}": v for k, v in values.items()}

    def close(self) -> None:
        """Nothing runs beside a dataset's pipeline."""
