"""Prefixes with branches -> packed rows and their targets as a `core.batch.PackedBatch` (GRPO's groups; DPO's
pairs sharing a prompt next; a padding-free SFT step's examples, `core.data`). Token streams packed by the
data pipeline (pretraining, SFT) become one in `core.data.to_data_batch`.

    segments = [Segment(prefix=prompt, branches=(completion_a, completion_b)), ...]
    rows = pack_rows([segments_of_group_0, segments_of_group_1], row_len=512)
    index, ids = branch_targets(rows, group=0, segment=0, branch=1)       # completion_a's targets
    batch = packed_batch(rows, [(index, ids), ...], max_targets=C)

A `Segment` is a prefix (branch 0) and zero or more branches after it; each
branch attends to the prefix and to itself only, with positions continuing
the prefix's (`core.kernels.attention.make_mask`). Segments are placed in rows
of `row_len` tokens first-fit decreasing, separately for each *packing group*
(one per optimizer mini-batch x micro-batch, so that cutting every array into
equal slices along its first axis gives self-contained micro-batches), and
every group gets the same number of rows: `choose_rows(most rows any group
needs)` (default `round_rows`), a multiple of `row_multiple` (the trainer's
data-parallel size). `pack=False` puts one segment per row.

Target j of a branch is its token j, predicted from the prefix's last position
(j = 0) or from the branch's token j - 1. Indices are flat within the group's
`[R_g * row_len]` positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from core.batch import PackedBatch


@dataclass(frozen=True)
class Segment:
    prefix: Sequence[int]  # branch 0, attended to by every branch
    branches: Sequence[Sequence[int]] = ()  # branch k >= 1 attends to the prefix and itself

    @property
    def length(self) -> int:
        return len(self.prefix) + sum(len(b) for b in self.branches)


@dataclass(frozen=True)
class Placement:
    row: int  # within its group's rows
    start: int  # where the prefix begins in the row
    branch_starts: tuple[int, ...]  # where each branch begins in the row


@dataclass
class PackedRows:
    tokens: np.ndarray  # [R, L]
    positions: np.ndarray
    segment_ids: np.ndarray
    branch_ids: np.ndarray
    rows_per_group: int
    groups: list[list[Segment]]
    placements: list[list[Placement]] = field(default_factory=list)  # [group][segment]

    @property
    def row_len(self) -> int:
        return int(self.tokens.shape[1])


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Item indices per row, each row's lengths summing to <= row_len."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > row_len:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens > row length {row_len}")
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def round_rows(n: int, multiple: int = 1) -> int:
    """Rows per group, rounded up to two sizes per power of two (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) and to
    `multiple`. Each new row count compiles the step once (~8 s at 100M on 2 CPU cores), so few distinct
    counts matter more than the last padding row (at most a third of the rows are padding)."""
    if n > 2:
        p = 1 << (n - 1).bit_length()
        n = 3 * p // 4 if n <= 3 * p // 4 else p
    return round_up(n, multiple)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def share_prefixes(prefixes: Sequence[Sequence[int]], branch_lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Items grouped by identical prefix tokens (first-seen order), each group cut so that one copy of the
    prefix plus its branches fits in `row_len` tokens: the items of one segment each."""
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    for i, prefix in enumerate(prefixes):
        by_prefix.setdefault(tuple(prefix), []).append(i)
    segments = []
    for prefix, items in by_prefix.items():
        segment: list[int] = []
        used = len(prefix)
        for i in items:
            if segment and used + branch_lengths[i] > row_len:
                segments.append(segment)
                segment, used = [], len(prefix)
            segment.append(i)
            used += branch_lengths[i]
        segments.append(segment)
    return segments


def pack_rows(
    groups: Sequence[Sequence[Segment]],
    row_len: int,
    *,
    pack: bool = True,
    row_multiple: int = 1,
    choose_rows: Callable[[int], int] | None = None,
    pad_id: int = 0,
) -> PackedRows:
    """Every group's segments in rows of `row_len` (layout in the module docstring)."""
    for g, segments in enumerate(groups):
        for s, seg in enumerate(segments):
            if not seg.prefix:
                raise ValueError(f"group {g}, segment {s}: empty prefix (a branch needs a token to follow)")
            if seg.length > row_len:
                raise ValueError(f"group {g}, segment {s}: {seg.length} tokens > row length {row_len}")
    layouts = [
        [[s] for s in range(len(segments))] if not pack else first_fit_decreasing([s.length for s in segments], row_len)
        for segments in groups
    ]
    most = max(len(rows) for rows in layouts)
    if not pack:
        per_group = round_up(most, row_multiple)
    else:
        per_group = (choose_rows or (lambda n: round_rows(n, row_multiple)))(most)
        if per_group < most or per_group % row_multiple:
            raise ValueError(
                f"choose_rows({most}) = {per_group}: need at least {most} rows per group, a multiple of {row_multiple}"
            )
    r = per_group * len(groups)
    out = PackedRows(
        tokens=np.full((r, row_len), pad_id, np.int32),
        positions=np.zeros((r, row_len), np.int32),
        segment_ids=np.zeros((r, row_len), np.int32),
        branch_ids=np.zeros((r, row_len), np.int32),
        rows_per_group=per_group,
        groups=[list(s) for s in groups],
    )
    for g, (segments, rows) in enumerate(zip(groups, layouts)):
        placements: list[Placement | None] = [None] * len(segments)
        for local_row, members in enumerate(rows):
            row, offset = g * per_group + local_row, 0
            for segment_id, s in enumerate(members, start=1):
                seg = segments[s]
                start, p = offset, len(seg.prefix)
                _write(out, row, offset, seg.prefix, np.arange(p), segment_id, 0)
                offset += p
                starts = []
                for branch, tokens in enumerate(seg.branches, start=1):
                    starts.append(offset)
                    _write(out, row, offset, tokens, p + np.arange(len(tokens)), segment_id, branch)
                    offset += len(tokens)
                placements[s] = Placement(local_row, start, tuple(starts))
        out.placements.append([p for p in placements if p is not None])
    return out


def _write(out: PackedRows, row: int, offset: int, tokens, positions, segment_id: int, branch: int) -> None:
    n = len(tokens)
    out.tokens[row, offset : offset + n] = tokens
    out.positions[row, offset : offset + n] = positions
    out.segment_ids[row, offset : offset + n] = segment_id
    out.branch_ids[row, offset : offset + n] = branch


def branch_targets(rows: PackedRows, group: int, segment: int, branch: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat predicting positions, target ids) of every token of a branch (branch >= 1), local to its group."""
    seg, where = rows.groups[group][segment], rows.placements[group][segment]
    tokens = np.asarray(seg.branches[branch - 1], np.int32)
    n = len(tokens)
    if not n:
        return np.zeros((0,), np.int32), tokens
    base = where.row * rows.row_len
    start = where.branch_starts[branch - 1]
    prefix_last = where.start + len(seg.prefix) - 1
    return base + np.r_[prefix_last, start + np.arange(n - 1)].astype(np.int32), tokens


def packed_batch(rows: PackedRows, targets: Sequence[tuple[np.ndarray, np.ndarray]], max_targets: int) -> PackedBatch:
    """The `PackedBatch` of `rows` with one scored sequence per `(index, ids)` in `targets`, in order; each
    padded to `max_targets` (C)."""
    b = len(targets)
    index = np.zeros((b, max_targets), np.int32)
    ids = np.zeros((b, max_targets), np.int32)
    mask = np.zeros((b, max_targets), np.float32)
    for i, (idx, tok) in enumerate(targets):
        n = len(idx)
        if n > max_targets:
            raise ValueError(f"scored sequence {i} has {n} targets > {max_targets}")
        index[i, :n], ids[i, :n], mask[i, :n] = idx, tok, 1.0
    return PackedBatch(
        rows.tokens, rows.positions, rows.segment_ids, rows.branch_ids, index, ids, mask, groups=len(rows.groups)
    )
