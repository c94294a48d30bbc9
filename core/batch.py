"""The one batch every method trains on: sequences packed into rows, and the tokens a loss scores.

    batch = PackedBatch(tokens, positions, segment_ids, branch_ids, target_index, target_ids, target_mask)
    micro = core.train.split_micro_batches(batch, k)   # every leaf [N, ...] -> [k, N / k, ...]
    placed = core.train.place_batch(micro, mesh)       # the batch axis over the mesh's data axes

Rows hold whole sequences (a document, a conversation, a prompt with its
completions, a prompt with a chosen and a rejected answer), each in its own
segment; within a segment, branch 0 is a shared prefix and branch k >= 1 a
continuation that attends to the prefix and to itself only. A *scored
sequence* is what a loss sums over (a row of pretraining text, a
conversation's assistant tokens, one completion, one side of a preference
pair): target j of scored sequence i is predicted by the hidden state at
`target_index[i, j]`, a flat index into the `[R_g * L]` positions of its
packing group (the rows that travel together in one micro-batch).

    tokens, positions, segment_ids  [R, L] int32   (segment 0 = padding; positions restart per segment)
    branch_ids                      [R, L] int32
    target_index, target_ids        [B, C] int32
    target_mask                     [B, C] float32  1 where target j exists
    groups                          int (static)    packing groups: the micro-batches it was packed for
    scored                          int (static)    targets the output head scores per micro-batch
    compact                         int (static)    positions the layers run on per part (0 = all)

`target_index` is local to each packing group, so a batch splits into exactly `groups` micro-batches:
`core.train.split_micro_batches` refuses another count, naming both (a builder and a learner can no longer
disagree about it silently).

Real targets rarely fill `[B, C]` (C is the longest scored sequence, bucketed), and the vocabulary-sized
output projection is the costliest per-target work there is, so `core.targets.target_logprobs` scores a flat
list of the `scored` real targets of each micro-batch and scatters the results back (zeros on empty slots).
`split_micro_batches` sets `scored` from the mask once the micro-batches are known (`with_scored`); 0 scores
every slot. Padding positions in the rows likewise never reach the matmuls of the decoder layers: `compact`
(set by `with_compact`) lets the model run them on the real tokens only (`core.models.compact`). Both are
static, so each new count compiles the step again: a learner passes its `CompiledCounts`, which reuses a larger
count already compiled for a batch that fits it (a short run compiles what it must, not one step per bucket).

Methods add their own per-target or per-sequence arrays beside it in a typed
batch of their own (`TrainBatch`: `posttrain.onpolicy.rl_batch.RLBatch`,
`posttrain.dpo.pairs.PairBatch`); `core.targets.target_logprobs` turns a
`PackedBatch` and a model into `[B, C]` log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import jax
import numpy as np

from core.mesh import row_shards
from core.shapes import SizeCache

T = TypeVar("T")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedBatch:
    tokens: Any  # [R, L] int32
    positions: Any  # [R, L] int32
    segment_ids: Any  # [R, L] int32, 0 = padding
    branch_ids: Any  # [R, L] int32, 0 = prefix, k >= 1 = branch k
    target_index: Any  # [B, C] int32, flat into the group's [R_g * L] positions
    target_ids: Any  # [B, C] int32
    target_mask: Any  # [B, C] float32
    # Packing groups: contiguous equal slices of the rows (and of the targets) that are each self-contained, one
    # per micro-batch the batch is packed for (static: part of the compiled shape, and checked when it is split).
    groups: int = field(default=1, metadata=dict(static=True))
    # Real targets the head scores per micro-batch (bucketed; static, so part of the compiled shape); 0 = all.
    scored: int = field(default=0, metadata=dict(static=True))
    # Positions the position-wise layers run on per part of a micro-batch's rows (`core.models.compact`;
    # bucketed, static); 0 = every position of the rows.
    compact: int = field(default=0, metadata=dict(static=True))
    # Routing replay (a mixture-of-experts model): the experts the trained model's sampler routed each row position's
    # token to, [R, L, sparse layers, k] int32, -1 where it routed none (padding); None: no routes. With `replay` the
    # trained model's forward pass uses them in place of its routers' own top-k; without it they are only compared
    # (the routing mismatch, `moe/route_mismatch`). Only a pass that says it runs the sampled model reads them
    # (`core.targets.target_states(..., routed=True)`); any other model run on the batch (frozen, or another
    # trained part of the module tree) routes as its own routers do.
    routes: Any = None
    replay: bool = field(default=False, metadata=dict(static=True))

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def packed(self) -> PackedBatch:
        """Itself: a bare PackedBatch is the batch of the methods that need nothing beside it (pretraining, SFT)."""
        return self

    def fill(self) -> float:
        """Share of the row slots that hold a real token (1 - padding)."""
        return float((np.asarray(self.segment_ids) > 0).mean())


class TrainBatch(Protocol):
    """What every method's batch is: its sequences as a `PackedBatch` (`.packed`), with the method's own per-target
    or per-sequence arrays beside it (`posttrain.onpolicy.rl_batch.RLBatch`, `posttrain.dpo.pairs.PairBatch`).
    A registered pytree dataclass, so that `core.train` splits, places and scores it like any other."""

    @property
    def packed(self) -> PackedBatch: ...


def packing_groups(tree: Any) -> list[tuple[str, int]]:
    """(where, packing groups) of every `PackedBatch` in `tree`."""
    found = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, PackedBatch))[0]:
        if isinstance(x, PackedBatch):
            found.append((jax.tree_util.keystr(path), x.groups))
    return found


def with_groups(tree: T, groups: int) -> T:
    """Every `PackedBatch` in `tree` marked as packed for `groups` packing groups (a slice of a batch: a
    mini-batch of an on-policy step holds its share of the groups)."""
    return jax.tree.map(
        lambda x: replace(x, groups=groups) if isinstance(x, PackedBatch) else x,
        tree,
        is_leaf=lambda x: isinstance(x, PackedBatch),
    )


class CompiledCounts:
    """The `scored` and `compact` counts a learner's update has been compiled for, one `core.shapes.SizeCache` per
    count and width: a batch whose count fits one already compiled (at most twice its own bucket) is padded into
    it instead of compiling the step again, until a bucket has been padded often enough to earn its own
    compilation (the cache's patience). A compilation costs seconds (8-10 s for the tools demo's ~1M model on 2
    CPU cores, against a 0.3 s update), padding a few hundred targets or positions milliseconds. Every process of
    a JAX group sees the same batches in the same order, so they pick the same counts."""

    def __init__(self):
        self._caches: dict[tuple[str, int], SizeCache] = {}

    def pick(self, count: str, slots: int, needed: int, bucket: Callable[[int], int]) -> int:
        """The count to use for `needed` of `slots` (`bucket`: how a new count is rounded, fixed per width)."""
        cache = self._caches.setdefault((count, slots), SizeCache(bucket))
        return cache.pick(needed)


def _pick(counts: CompiledCounts | None, count: str, slots: int, needed: int, bucket: Callable[[int], int]) -> int:
    """`bucket(needed)`, or, with `counts`, a larger count already compiled that holds it."""
    return bucket(needed) if counts is None else counts.pick(count, slots, needed, bucket)


def scored_bucket(needed: int, slots: int) -> int:
    """`needed` real targets of a micro-batch's `slots` rounded up, so that a run compiles its step for a handful of
    counts: quarters of up to 256 slots, then steps of 64 targets (at most 16 counts), where each padded target
    costs a vocabulary-sized row of the head (~0.5 ms at 56M on 2 CPU cores). Every slot below 4."""
    if slots < 4:
        return slots
    step = max(-(-slots // 16), min(64, slots // 4))
    return min(slots, max(1, -(-needed // step)) * step)


# Below this many positions a part, compaction saves too little to pay for another compiled shape (the test
# suite's batches, the tiny benchmark's).
COMPACT_MIN_SLOTS = 1024


def compact_bucket(needed: int, positions: int) -> int:
    """`needed` real tokens of a part's `positions` rounded up to an eighth of them; every position below
    `COMPACT_MIN_SLOTS`."""
    if positions < COMPACT_MIN_SLOTS:
        return positions
    step = -(-positions // 8)
    return min(positions, max(1, -(-needed // step)) * step)


def with_scored(tree: T, counts: CompiledCounts | None = None) -> T:
    """Every `PackedBatch` in `tree` (host arrays, before its `groups` micro-batches are split off) with `scored` set
    to the most real targets any micro-batch holds, rounded up (a quarter of its `[B / groups, C]` slots, or
    64 targets in larger batches: see below) so that a run compiles its step for a handful of counts; with
    `counts`, a larger count already compiled that holds it."""

    def one(x):
        if not isinstance(x, PackedBatch):
            return x
        groups = x.groups
        mask = np.asarray(x.target_mask)
        if mask.shape[0] % groups:
            return x  # split_micro_batches names the leaf that does not divide
        per_group = mask.reshape(groups, -1)
        most = int((per_group > 0).sum(axis=1).max())
        slots = per_group.shape[1]
        if slots < 4:
            return replace(x, scored=0)
        # Each count is another compilation (the test suite's small models compile more than they run): coarse.
        return replace(x, scored=_pick(counts, "scored", slots, most, lambda n: scored_bucket(n, slots)))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, PackedBatch))


def with_compact(tree: T, mesh_shape: dict[str, int] | None = None, counts: CompiledCounts | None = None) -> T:
    """Every `PackedBatch` in `tree` (host arrays, before its `groups` micro-batches are split off) with `compact`
    set to the most real tokens any part of a micro-batch holds (a part: the rows of one data shard on a mesh
    of `mesh_shape`, `core.mesh.row_shards`), rounded up to an eighth of the part's positions so that a run
    compiles its step for a handful of counts (with `counts`, a larger count already compiled that holds it);
    0 (every position) when that saves nothing or the part is smaller than `COMPACT_MIN_SLOTS`."""

    def one(x):
        if not isinstance(x, PackedBatch):
            return x
        groups = x.groups
        real = np.asarray(x.segment_ids) > 0
        if real.shape[0] % groups:
            return x  # split_micro_batches names the leaf that does not divide
        shards = row_shards(real.shape[0] // groups, mesh_shape or {})
        parts = real.reshape(groups * shards, -1)  # a micro-batch's rows are contiguous, and so are a shard's
        slots = parts.shape[1]
        if slots < COMPACT_MIN_SLOTS:
            return replace(x, compact=0)
        count = _pick(counts, "compact", slots, int(parts.sum(axis=1).max()), lambda n: compact_bucket(n, slots))
        return replace(x, compact=count if count < slots else 0)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, PackedBatch))


def pad_rows(batch: T, rows: int) -> T:
    """A short batch (the last of an eval split) padded with zeros to `rows` rows: padding segments, zero target
    masks. Every leaf grows in proportion to the first leaf's rows (`[B, C]` leaves with B = R grow alike)."""
    first = jax.tree.leaves(batch)[0].shape[0]
    if first >= rows:
        return batch

    def pad(x):
        want = x.shape[0] * rows // first
        return np.concatenate([x, np.zeros((want - x.shape[0], *x.shape[1:]), x.dtype)])

    return jax.tree.map(pad, batch)
