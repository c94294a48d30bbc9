"""The shapes a learner's update runs in, chosen so that a step waits for a compilation only when no compiled shape
holds its batch, and compiled ahead, in a background thread, when a run is likely to need them.

    plan = ShapePlan(compile_fn, mesh_shape, row_multiple, ahead=True)
    shape, batch = plan.shape(batch)      # the batch padded into the shape it runs in (compiled, or compiled now)

A packed batch's arrays are fixed by its method and config (its row length, its scored sequences and their target
slots: its *family*), except three numbers that follow how many tokens it holds, each part of the compiled program
(`core.batch.PackedBatch`): the rows of each packing group, the targets the output head scores per micro-batch
(`scored`) and the positions each part of a micro-batch's rows runs its layers on (`compact`). A `ShapePlan` picks
the three per batch (a `Shape`):

- the batch's own bucket (each number rounded up, `bucket`) when it is compiled;
- else the cheapest compiled shape that holds the batch at no more than `slack` times its bucket in each number:
  the batch is padded into it (rows of padding at the end of each packing group, unused target and position
  slots). A bucket padded `patience` times is compiled ahead, so that later batches run in their own shape;
- else the bucket, compiled now: the one compilation a step waits for. Ahead of need, the shape of a batch half as
  large again (`grow`) is compiled next, so that a run whose batches grow finds it ready.

Compiling ahead happens in one background thread (`core.compile_ahead.BackgroundCompiler`, at the lowest CPU
priority): a shape it compiles is used once ready and never waited for while another fits. In a JAX process group
every process must run the same programs, so a shape compiled ahead is used once it is ready on every process (a
collective decides). Rows grow only where more rows can hold the same sequences (a batch packs several sequences in
a row); a batch whose every row is its own scored sequence keeps its rows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from core.batch import PackedBatch, compact_bucket, scored_bucket
from core.compile_ahead import BackgroundCompiler
from core.compile_cache import compile_clock
from core.mesh import row_shards
from core.packing import round_rows

GROWTH = 1.5  # how much larger than the latest compiled shape the one compiled ahead is


@dataclass(frozen=True, order=True)
class Shape:
    rows: int  # rows of each packing group
    scored: int  # targets the head scores per micro-batch (all of its slots: every one)
    compact: int  # positions each part of a micro-batch's rows runs the layers on (all of them: every one)


class Need:
    """What one host batch needs: its family, its rows, its real targets per micro-batch and, for any row count, its
    real tokens per part of a micro-batch's rows."""

    def __init__(self, batch: Any, mesh_shape: dict[str, int]):
        packed: PackedBatch = batch.packed
        self.mesh_shape = mesh_shape
        self.groups = packed.groups
        total_rows, self.width = np.asarray(packed.tokens).shape
        if total_rows % self.groups:
            raise ValueError(f"a batch of {total_rows} rows cannot be cut into {self.groups} packing groups")
        self.rows = total_rows // self.groups
        mask = np.asarray(packed.target_mask).reshape(self.groups, -1)
        self.scored_slots = mask.shape[1]
        self.sequences = np.asarray(packed.target_mask).shape[0] // self.groups  # scored sequences per group
        self.scored = int((mask > 0).sum(axis=1).max())
        self.real = (np.asarray(packed.segment_ids) > 0).reshape(self.groups, self.rows, self.width)
        self.family = family_of(batch)
        self._compact: dict[int, int] = {}

    def parts(self, rows: int) -> int:
        """Parts of a micro-batch's `rows` rows: its data shards on the mesh."""
        return row_shards(rows, self.mesh_shape)

    def positions(self, rows: int) -> int:
        """Positions in one part of a micro-batch of `rows` rows."""
        return rows // self.parts(rows) * self.width

    def compact(self, rows: int) -> int:
        """The most real tokens in any part of a micro-batch laid out in `rows` rows (padding rows at its end)."""
        if rows not in self._compact:
            padded = np.zeros((self.groups, rows, self.width), bool)
            padded[:, : self.rows] = self.real
            self._compact[rows] = int(padded.reshape(self.groups * self.parts(rows), -1).sum(axis=1).max())
        return self._compact[rows]

    @property
    def rows_vary(self) -> bool:
        """Whether more rows could hold these sequences: a row packs several of them (a batch whose every row is its
        own scored sequence keeps its rows)."""
        return self.sequences > self.rows


def family_of(batch: Any) -> tuple:
    """What two batches must share to run in one compiled shape: every array's shape but the rows of the packed
    ones, every dtype, and the static fields but the counts a plan sets."""
    packed: PackedBatch = batch.packed
    row_arrays = {id(x) for x in (packed.tokens, packed.positions, packed.segment_ids, packed.branch_ids)}
    if packed.routes is not None:
        row_arrays.add(id(packed.routes))
    leaves, treedef = jax.tree.flatten(_with_counts(batch, 0, 0))
    shapes = tuple((np.shape(x)[1:] if id(x) in row_arrays else np.shape(x), str(np.asarray(x).dtype)) for x in leaves)
    return (treedef, shapes)


def bucket(need: Need, row_multiple: int) -> Shape:
    """The shape a batch gets to itself."""
    rows = round_rows(need.rows, row_multiple)
    return Shape(
        rows, scored_bucket(need.scored, need.scored_slots), compact_bucket(need.compact(rows), need.positions(rows))
    )


def grow(shape: Shape, need: Need, row_multiple: int) -> Shape:
    """The shape of a batch `GROWTH` times as large as `shape` in each number (rows only where they vary)."""
    rows = shape.rows
    if need.rows_vary:
        rows = min(round_rows(math.ceil(GROWTH * rows), row_multiple), round_rows(need.sequences, row_multiple))
    scored = scored_bucket(min(need.scored_slots, math.ceil(GROWTH * shape.scored)), need.scored_slots)
    positions = need.positions(rows)
    wanted = max(need.compact(rows), math.ceil(GROWTH * shape.compact))  # rows regrouped into parts shift tokens
    return Shape(rows, scored, compact_bucket(min(positions, wanted), positions))


def fits(shape: Shape, need: Need) -> bool:
    return shape.rows >= need.rows and shape.scored >= need.scored and shape.compact >= need.compact(shape.rows)


def cost(shape: Shape, need: Need) -> int:
    """Positions the layers run on plus targets the head scores: what padding into a shape costs."""
    return need.groups * (need.parts(shape.rows) * shape.compact + shape.scored)


def _with_counts(batch: Any, scored: int, compact: int) -> Any:
    packed = dataclasses.replace(batch.packed, scored=scored, compact=compact)
    return packed if isinstance(batch, PackedBatch) else dataclasses.replace(batch, packed=packed)


def apply(batch: Any, shape: Shape, need: Need) -> Any:
    """`batch` laid out in `shape`: each packing group padded with empty rows at its end (a target's index into its
    group's positions is unchanged), its static counts set (0: all slots, as `PackedBatch` reads them)."""
    packed: PackedBatch = batch.packed
    if shape.rows != need.rows:
        extra = shape.rows - need.rows

        def pad(x, fill=0):
            x = np.asarray(x)
            grouped = x.reshape(need.groups, need.rows, *x.shape[1:])
            padding = np.full((need.groups, extra, *x.shape[1:]), fill, x.dtype)
            return np.concatenate([grouped, padding], axis=1).reshape(need.groups * shape.rows, *x.shape[1:])

        packed = dataclasses.replace(
            packed,
            tokens=pad(packed.tokens),
            positions=pad(packed.positions),
            segment_ids=pad(packed.segment_ids),
            branch_ids=pad(packed.branch_ids),
            routes=None if packed.routes is None else pad(packed.routes, -1),
        )
        batch = packed if isinstance(batch, PackedBatch) else dataclasses.replace(batch, packed=packed)
    scored = 0 if shape.scored >= need.scored_slots else shape.scored
    compact = 0 if shape.compact >= need.positions(shape.rows) else shape.compact
    return _with_counts(batch, scored, compact)


class ShapePlan:
    """The shapes one learner's update is compiled for, and the choice of one per batch (module docstring).
    `compile_fn(batch)` compiles the update for a host batch's shapes (it may run in the background thread);
    `agree(flag)`: whether `flag` holds on every process of the group (a collective; default: a group of one)."""

    def __init__(
        self,
        compile_fn: Callable[[Any], None],
        mesh_shape: dict[str, int],
        row_multiple: int = 1,
        *,
        ahead: bool = True,
        slack: float = 2.0,
        patience: int = 4,
        agree: Callable[[bool], bool] | None = None,
    ):
        self.compile_fn, self.mesh_shape, self.row_multiple = compile_fn, mesh_shape, row_multiple
        self.ahead, self.slack, self.patience = ahead, slack, patience
        self.agree = agree or (lambda flag: flag)
        self.ready: dict[tuple, set[Shape]] = {}  # family -> shapes compiled
        self.pending: dict[tuple, dict[Shape, Future]] = {}  # family -> shapes being compiled ahead
        self.padded: dict[tuple, dict[Shape, int]] = {}  # family -> bucket -> batches padded into another shape
        self._compiler = BackgroundCompiler("update")

    # ------------------------------------------------------------------ choosing

    def shape(self, batch: Any) -> tuple[Shape, Any]:
        """The shape `batch` runs in, and the batch laid out in it; compiled when this returns."""
        need = Need(batch, self.mesh_shape)
        family = need.family
        ready = self.ready.setdefault(family, set())
        self._collect(family)
        own = bucket(need, self.row_multiple)
        if own in ready:
            return own, apply(batch, own, need)
        holding = [s for s in ready if fits(s, need) and self._within(s, own)]
        if holding:
            self._padded_into(family, own, batch)
            best = min(holding, key=lambda s: (cost(s, need), s))
            return best, apply(batch, best, need)
        pending = self.pending.get(family, {})
        if own in pending:  # compiled ahead, not ready yet: wait for it rather than compile it twice
            self._wait_for(pending.pop(own), lambda: self.compile_fn(apply(batch, own, need)))
        else:
            self.compile_fn(apply(batch, own, need))
        ready.add(own)
        if self.ahead:
            self._submit(family, grow(own, need, self.row_multiple), batch)
        return own, apply(batch, own, need)

    def _wait_for(self, future: Future, compile_here: Callable[[], None]) -> None:
        """Wait for a shape compiled ahead. Where it failed on any process of a group, every process compiles it
        here (meeting the error; the others find it compiled): the group decides together, so its processes run the
        same collectives and start the program together (the background thread skips the learner's barrier)."""
        start = time.perf_counter()
        failed = future.exception() is not None  # waits for it
        compile_clock().add_wait(time.perf_counter() - start)
        if not self.agree(not failed):
            compile_here()

    def _within(self, shape: Shape, own: Shape) -> bool:
        return all(a <= self.slack * b for a, b in zip(dataclasses.astuple(shape), dataclasses.astuple(own)))

    def _padded_into(self, family: tuple, own: Shape, batch: Any) -> None:
        padded = self.padded.setdefault(family, {})
        padded[own] = padded.get(own, 0) + 1
        if self.ahead and padded[own] >= self.patience:
            self._submit(family, own, batch)

    def _collect(self, family: tuple) -> None:
        """Shapes compiled ahead that are now ready (on every process of a group) join the compiled ones."""
        pending = self.pending.get(family, {})
        for shape in sorted(pending):  # the same order on every process
            future = pending[shape]
            if self.agree(future.done()):
                pending.pop(shape)
                if self.agree(future.exception() is None):  # failed anywhere: compiled again when a batch needs it
                    self.ready[family].add(shape)

    # ------------------------------------------------------------------ ahead

    def _submit(self, family: tuple, shape: Shape, batch: Any) -> None:
        """Compile `shape` for `batch`'s family in the background, unless it is compiled or on its way."""
        pending = self.pending.setdefault(family, {})
        if shape in self.ready.get(family, set()) or shape in pending:
            return
        need = Need(batch, self.mesh_shape)
        if not fits(shape, need):  # a shape no smaller than the batch (rows never shrink below what it holds)
            return
        example = apply(batch, shape, need)
        # A job that fails leaves the shape to the step that needs it, which compiles it and meets the error.
        pending[shape] = self._compiler.submit(lambda: self.compile_fn(example))

    def close(self) -> None:
        """Drop the shapes not yet compiled ahead (the one compiling finishes in its daemon thread)."""
        self._compiler.cancel()
