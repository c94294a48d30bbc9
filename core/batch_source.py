"""Where a run's batches come from: a dataset's Grain pipeline, read once per step.

    source = DatasetSource(pipeline, prepare=attach_stored_values)   # any iterable of core.data.DataBatch
    batch = source.next()                  # what the method's loss reads (before `Method.attach`)
    source.after_update(trainer)           # nothing for a dataset: its rows do not depend on the weights
    checkpointer.save(state, source.state, ...)   # the Grain iterator: its position restores the exact next batch

A source hands the trainer one batch per step and hears of each update (`after_update`: the samplers' source,
`posttrain.onpolicy.source.SamplerSource`, syncs the weights there; a dataset's does nothing). A dataset's source is
the method's pipeline (training rows, shuffled per epoch and repeated: `core.data.epochs`) and its `prepare`: what
turns a pipeline item into the batch the loss reads, from data the run holds (values stored before the run, gathered
by example id). Values computed by frozen models belong to `core.method.Method.attach`, beside the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from core.data import DataBatch

# (a pipeline's item, the packing groups its rows form: train.micro_batches when training, 1 when evaluating)
# -> what the method's loss reads.
Prepare = Callable[[DataBatch, int], Any]


def as_is(data: DataBatch, groups: int) -> Any:
    return data.batch


class BatchSource(Protocol):
    """One batch per step, told of every update, with a position a checkpoint keeps."""

    def next(self) -> Any: ...

    def after_update(self, trainer: Any) -> Any: ...

    @property
    def state(self) -> Any: ...


class DatasetSource:
    """A dataset's batches (module docstring): `next_item` is the pipeline's item (its example ids, for whoever
    inspects it), `prepare` what the loss reads of it; `next` both."""

    def __init__(self, pipeline: Iterable[DataBatch], prepare: Prepare = as_is, micro_batches: int = 1):
        self.iterator = iter(pipeline)
        self._prepare = prepare
        self.micro_batches = micro_batches

    def next_item(self) -> DataBatch:
        return next(self.iterator)

    def prepare(self, item: DataBatch, groups: int | None = None) -> Any:
        """What the loss reads of `item`, packed for `groups` (default: the training step's micro-batches)."""
        return self._prepare(item, self.micro_batches if groups is None else groups)

    def next(self) -> Any:
        return self.prepare(self.next_item())

    def after_update(self, trainer: Any) -> None:
        """A dataset's rows do not depend on the weights."""

    @property
    def state(self) -> Any:
        """The Grain iterator: what a checkpoint saves and restores (`core.checkpoint.Checkpointer`)."""
        return self.iterator
