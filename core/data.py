"""Data: rows from a source, read by a method's row format into token examples, in resumable Grain pipelines.

    records = load_records(cfg.data)                                    # core.sources: the rows of data.source
    examples = tokenize_examples(records, TextRows(), tokenizer, cfg.data)   # validated + tokenized, split
    pipeline = make_pipeline(examples, cfg.data, batch_size=8, micro_batches=2)
    for item in pipeline:            # DataBatch: .batch (a core.batch.PackedBatch), .example_ids
        learner.update(item.batch, micro_batches=2)

Rows come from `core.sources.load_records` (`data.source`, `data.columns`).

A method reads rows through its `RowFormat`: which fields a row needs (a malformed row is named: source, row,
field, what is wrong) and how it becomes token ids and target positions (pretraining's text, SFT's prompt /
completion and chat rows). Every row is validated and tokenized once, up front; a row that cannot be used
raises `MalformedRow`, or with `data.skip_malformed` is skipped and counted (`Examples.skipped`). The last
`data.eval_fraction` of the usable rows is held out (`held_out`, the one split every method uses).

Batches are `DataBatch`es: a `PackedBatch` with one scored sequence per row (its targets packed to the left of
`[B, C]`, C <= seq_len, `target_index` local to each of `micro_batches` groups of rows) and `example_ids` `[B, L]`
(the source row of every token, -1 on padding). With `data.packing` several examples share a row (Grain's
first-fit packer), each with its own segment and positions; no token attends across examples. With
`data.padding_free` (and no packing) each step still takes `batch_size` examples, but lays them first-fit
decreasing into the fewest rows of `data.seq_len` (`core.packing.pack_rows`, segments as with packing), so the
model runs on the examples' tokens rather than on rows padded to the longest: the same examples, loss and
gradient as padded rows, in fewer rows. The iterator's state (`get_state` / `set_state`, or Orbax via
`grain.checkpoint`) restores to the exact next batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grain
import numpy as np

from core.batch import PackedBatch
from core.config import DataConfig
from core.encoding import encode_document
from core.errors import MissingPath, UserError
from core.packing import Segment, pack_rows, round_up
from core.shapes import bucketed_width
from core.sources import DataSourceError

T = TypeVar("T")
B = TypeVar("B")


class MalformedRow(UserError, ValueError):
    """A dataset row that cannot be used; the message names the source, row and field."""


# ---------------------------------------------------------------- row formats


class RowFormat(Protocol):
    """How a method reads a row: what makes it malformed, and its token ids and target positions."""

    def problem(self, row: dict) -> tuple[str, str] | None:
        """(field, what is wrong) for a row that cannot be used, or None."""
        ...

    def tokenize(self, row: dict, tokenizer: Any) -> tuple[list[int], list[int]]:
        """(token ids, positions of the target tokens) before truncation; a `UserError` for a row that cannot be
        tokenized (a chat template that cannot render it)."""
        ...


def string_fields_problem(row: Any, fields: Sequence[str]) -> tuple[str, str] | None:
    """The first of `fields` that is missing, not a string or empty, as (field, what is wrong)."""
    if not isinstance(row, dict):
        return "<row>", f"expected a mapping, got {type(row).__name__}"
    for name in fields:
        if name not in row or row[name] is None:
            return name, "missing"
        if not isinstance(row[name], str):
            return name, f"expected a string, got {type(row[name]).__name__}"
        if not row[name].strip():
            return name, "empty text"
    return None


def messages_problem(row: Any, field: str = "messages") -> tuple[str, str] | None:
    """What is wrong with a chat field: a non-empty list of {role: str, content: str} (other string fields such as
    `reasoning_content` or `thinking` ride along to the template). An assistant message may carry `tool_calls`
    instead of (or with) its content: a non-empty list of {function: {name: str, arguments: object or JSON
    string}}; the row may offer `tools`: a list of JSON schemas."""
    if not isinstance(row, dict):
        return "<row>", f"expected a mapping, got {type(row).__name__}"
    msgs = row.get(field)
    if msgs is None:
        return field, "missing"
    if not isinstance(msgs, list) or not msgs:
        return field, f"expected a non-empty list, got {type(msgs).__name__}"
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"{field}[{j}]", "expected {role: str, content: str}"
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant":
                return f"{field}[{j}].tool_calls", f"only an assistant message calls tools, not a {m['role']!r} one"
            for k, call in enumerate(calls if isinstance(calls, list) and calls else [None]):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    return f"{field}[{j}].tool_calls[{k}]", "expected {function: {name: str, arguments: ...}}"
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):  # OpenAI's form: a JSON string of the object
                    try:
                        arguments = json.loads(arguments)
                    except ValueError:
                        arguments = None
                if not isinstance(arguments, dict):
                    return f"{field}[{j}].tool_calls[{k}].function.arguments", "expected an object or a JSON string"
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            return f"{field}[{j}]", "expected {role: str, content: str}"
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "tools", "expected a list of JSON schemas (objects)"
    return None


@dataclass(frozen=True)
class TextRows:
    """Pretraining text: the `text` field as a document (`core.encoding.encode_document`: the tokenizer's BOS, the
    text, EOS); every token after the first is a target."""

    def problem(self, row: dict) -> tuple[str, str] | None:
        return string_fields_problem(row, ["text"])

    def tokenize(self, row: dict, tokenizer: Any) -> tuple[list[int], list[int]]:
        ids = encode_document(tokenizer, row["text"])
        return ids, list(range(1, len(ids)))


# ---------------------------------------------------------------- tokenising


@dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # [n] int32
    targets: np.ndarray  # [n] int32: 1 where the token is a target (never at position 0)


def load_tokenizer(tokenizer_dir: str):
    """A Hugging Face tokenizer from a directory (or a Hub model id, `core.hf.hub`)."""
    from core.hf.hub import resolve_model
    from core.tokenizer import open_tokenizer

    path = resolve_model(tokenizer_dir, "data.tokenizer_dir")
    if not path.is_dir():
        raise MissingPath(f"data.tokenizer_dir {tokenizer_dir!r}: no such directory")
    return open_tokenizer(path)


def truncate(ids: list[int], targets: list[int], length: int, side: str) -> tuple[list[int], list[int]]:
    """At most `length` tokens, cut on the right or the left; a target needs the token before it, so a target that
    becomes the first token is dropped."""
    if len(ids) <= length:
        return ids, targets
    if side == "right":
        return ids[:length], [k for k in targets if k < length]
    cut = len(ids) - length
    return ids[cut:], [k - cut for k in targets if k - cut >= 1]


def held_out(items: Sequence[T], fraction: float) -> tuple[list[T], list[T]]:
    """(training part, held-out part): the last `round(fraction * n)` items are held out. The one split every
    method uses (rows, pairs, prompts), so that a method's evaluation never sees a training row."""
    n_eval = round(fraction * len(items))
    return list(items[: len(items) - n_eval]), list(items[len(items) - n_eval :])


@dataclass
class Examples:
    """Every usable row of a source as an `Example`, split into training and held-out rows."""

    by_row: dict[int, Example]  # source row -> its example
    train: list[int]  # source rows of the training split, in order
    eval: list[int]  # source rows of the held-out split
    skipped: list[str] = field(default_factory=list)  # a description of each row left out
    source: str = "<records>"


def tokenize_examples(
    records: Sequence[dict], rows: RowFormat, tokenizer: Any, cfg: DataConfig, source: str | None = None
) -> Examples:
    """Validate and tokenize every row (truncated to `data.seq_len` on `data.truncation_side`), then hold out the
    last `data.eval_fraction` of the usable ones. A row that cannot be used raises `MalformedRow` naming it, or is
    skipped and counted with `data.skip_malformed`."""
    source = source or (cfg.source if isinstance(cfg.source, str) else None) or "<records>"
    by_row, skipped = {}, []
    for i in range(len(records)):
        row = records[i]
        bad = rows.problem(row)
        problem = f"field '{bad[0]}': {bad[1]}" if bad is not None else None
        if problem is None:
            try:
                ids, targets = rows.tokenize(row, tokenizer)
            except UserError as err:
                problem = str(err)
        if problem is None:
            ids, targets = truncate(ids, targets, cfg.seq_len, cfg.truncation_side)
            if not targets:
                problem = (
                    f"no target token left ({len(ids)} tokens after truncation to data.seq_len={cfg.seq_len} "
                    f"on the {cfg.truncation_side}; the loss would be empty)"
                )
        if problem is not None:
            message = f"{source}: row {i}: {problem}"
            if not cfg.skip_malformed:
                raise MalformedRow(message + " (set data.skip_malformed=true to skip such rows)")
            skipped.append(message)
            continue
        mask = np.zeros(len(ids), np.int32)
        mask[targets] = 1
        by_row[i] = Example(np.asarray(ids, np.int32), mask)
    if not by_row:
        raise MalformedRow(f"{source}: no usable rows ({len(skipped)} malformed)")
    train, held = held_out(sorted(by_row), cfg.eval_fraction)
    if not train:
        raise DataSourceError(f"{source}: no training rows left after data.eval_fraction={cfg.eval_fraction}")
    return Examples(by_row, train, held, skipped, source)


def _element(index: int, example: Example) -> dict[str, np.ndarray]:
    n = len(example.tokens)
    return {"tokens": example.tokens, "loss_mask": example.targets, "example_ids": np.full((n,), index, np.int32)}


def _pad_row(element: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    n = len(element["tokens"])
    pad = seq_len - n

    def padded(x, value=0):
        return np.concatenate([x, np.full((pad,), value, np.int32)])

    return {
        "tokens": padded(element["tokens"]),
        "loss_mask": padded(element["loss_mask"]),
        "example_ids": padded(element["example_ids"], -1),
        "segment_ids": padded(np.ones((n,), np.int32)),
        "positions": padded(np.arange(n, dtype=np.int32)),
    }


def _padding_free(elements: Sequence[dict[str, np.ndarray]], seq_len: int, groups: int, row_multiple: int):
    """One step's examples in the fewest rows (`core.packing.pack_rows`, first-fit decreasing): each micro-batch
    group's (consecutive) examples in rows of their own, every group the same number of rows (a multiple of
    `row_multiple`, the data-parallel size), each example its own segment with positions from 0.

    Rows are `seq_len` wide, or 5/4 of it when that holds the step in fewer positions: two examples just over
    half of `seq_len` cannot share a row of `seq_len` but can share the wider one (a 56M SFT step on 8 rows of
    33-256 tokens: 9.5% fewer positions, 5% faster; wider still costs more attention than it saves)."""
    per = len(elements) // groups
    parts = [elements[g * per : (g + 1) * per] for g in range(groups)]
    groups_of_segments = [[Segment(prefix=e["tokens"].tolist()) for e in part] for part in parts]

    def positions(p) -> int:  # what the step runs: rows x the width to_data_batch cuts them to
        used = int((p.segment_ids > 0).sum(axis=1).max())
        return p.tokens.shape[0] * bucketed_width(used, p.tokens.shape[1])

    candidates = (
        pack_rows(groups_of_segments, width, choose_rows=lambda most: round_up(most, row_multiple))
        for width in dict.fromkeys((seq_len, seq_len * 5 // 4))
    )
    packed = min(candidates, key=positions)  # the first (narrower) on a tie
    out = {"tokens": packed.tokens, "segment_ids": packed.segment_ids, "positions": packed.positions}
    out["loss_mask"] = np.zeros_like(packed.tokens)
    out["example_ids"] = np.full_like(packed.tokens, -1)
    for g, part in enumerate(parts):
        for e, where in zip(part, packed.placements[g], strict=True):
            row, n = g * packed.rows_per_group + where.row, len(e["tokens"])
            out["loss_mask"][row, where.start : where.start + n] = e["loss_mask"]
            out["example_ids"][row, where.start : where.start + n] = e["example_ids"]
    return out


def _from_packed(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = batch["tokens_segment_ids"].astype(np.int32)
    return {
        "tokens": batch["tokens"].astype(np.int32),
        "segment_ids": seg,
        "positions": batch["tokens_positions"].astype(np.int32),
        "loss_mask": np.where(seg > 0, batch["loss_mask"], 0).astype(np.int32),
        "example_ids": np.where(seg > 0, batch["example_ids"], -1).astype(np.int32),
    }


@dataclass(frozen=True)
class DataBatch(Generic[B]):
    """A pipeline's item: what the model trains on (a `PackedBatch`, or a method's batch holding one), and the
    source rows it came from (the method says at what granularity: every token's row here, `[B, L]`, -1 on
    padding)."""

    batch: B
    example_ids: np.ndarray


def to_data_batch(rows: dict[str, np.ndarray], micro_batches: int) -> DataBatch:
    """Row-layout arrays (tokens, positions, segment_ids, loss_mask `[B, L]`) -> a `DataBatch`: row i is scored
    sequence i, its targets packed to the left of `[B, C]`, indices local to its micro-batch's rows.

    Both axes are cut to what the batch uses (`bucketed_width`): rows to the longest row's real tokens, as a
    pad-to-longest collator does, and C to the fullest row's targets — L for text (every token a target),
    about the completion's share for SFT's completion-only loss, whose prompt positions then never reach the
    output projection. Padding only ever sits at a row's end, so the cut drops padding alone."""
    seg_full = rows["segment_ids"]
    length = bucketed_width(int((seg_full > 0).sum(axis=1).max()), seg_full.shape[1])
    rows = {k: v[:, :length] for k, v in rows.items()}
    tokens, seg = rows["tokens"], rows["segment_ids"]
    b = tokens.shape[0]
    per_group = b // micro_batches
    valid = np.zeros(tokens.shape, bool)  # position k is a target predicted from k - 1, in the same example
    valid[:, 1:] = (rows["loss_mask"][:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    width = bucketed_width(int(valid.sum(axis=1).max()), length)
    index = np.zeros((b, width), np.int32)
    ids = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), np.float32)
    for r in range(b):
        ks = np.flatnonzero(valid[r])
        n = len(ks)
        index[r, :n] = (r % per_group) * length + ks - 1
        ids[r, :n] = tokens[r, ks]
        mask[r, :n] = 1.0
    packed = PackedBatch(tokens, rows["positions"], seg, np.zeros_like(tokens), index, ids, mask, groups=micro_batches)
    return DataBatch(packed, rows["example_ids"])


# ---------------------------------------------------------------- pipelines


def epochs(n: int, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """Indices 0..n-1 forever, each epoch a fresh permutation of them (seeded) or in order: every training
    pipeline's order (rows, pairs, prompts)."""
    ds = grain.MapDataset.range(n)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None)  # after shuffle: every epoch gets a fresh permutation


@dataclass
class Pipeline:
    """A batched Grain dataset of one split, and the source rows it holds."""

    dataset: grain.IterDataset
    rows: list[int]  # the source rows of this split (this process's share)

    def __iter__(self):
        return iter(self.dataset)


def make_pipeline(
    examples: Examples,
    cfg: DataConfig,
    batch_size: int,
    *,
    split: str = "train",
    micro_batches: int = 1,
    row_multiple: int = 1,
    process_index: int = 0,
    process_count: int = 1,
) -> Pipeline:
    """Training split: shuffled, repeated forever, packed or padded. Eval split: one pass, in order.

    Rows are sharded across JAX processes (`process_index::process_count`), so every process sees a disjoint
    part. `micro_batches` is the train step's: target indices are local to each micro-batch. With
    `data.padding_free` a micro-batch's row count is a multiple of `row_multiple` (the data-parallel size, so
    that rows split evenly).
    """
    if batch_size % micro_batches:
        raise ValueError(f"batch size {batch_size} is not divisible by {micro_batches} micro-batches")
    usable = (examples.train if split == "train" else examples.eval)[process_index::process_count]
    if not usable:
        raise DataSourceError(f"{examples.source}: the {split} split is empty (data.eval_fraction={cfg.eval_fraction})")
    by_row = examples.by_row
    order = epochs(len(usable), seed=cfg.seed, shuffle=cfg.shuffle) if split == "train" else None
    ds = grain.MapDataset.source(usable) if order is None else order.map(lambda k: usable[k])
    it = ds.map(lambda i: _element(i, by_row[i])).to_iter_dataset()
    if cfg.packing and split == "train":
        lengths = {"tokens": cfg.seq_len, "loss_mask": cfg.seq_len, "example_ids": cfg.seq_len}
        it = grain.experimental.FirstFitPackIterDataset(
            it, length_struct=lengths, num_packing_bins=batch_size, shuffle_bins=False
        )
        it = it.batch(batch_size, drop_remainder=True).map(_from_packed)
    elif cfg.padding_free and split == "train":
        it = it.batch(batch_size, drop_remainder=True, batch_fn=list)
        it = it.map(lambda elements: _padding_free(elements, cfg.seq_len, micro_batches, row_multiple))
    else:
        it = it.map(lambda e: _pad_row(e, cfg.seq_len)).batch(batch_size, drop_remainder=split == "train")
    it = it.map(lambda rows: to_data_batch(rows, micro_batches if split == "train" else 1))
    return Pipeline(it, list(usable))
