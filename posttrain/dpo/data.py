"""Preference pairs as a resumable Grain pipeline of `PairBatch`es, the offline DPO run's data.

    data = load_pairs(cfg, tokenizer, records)        # PairData: train / eval pairs, skipped and dropped rows
    layout = PairLayout(seq_len=512, pack=True)
    pipeline = pair_pipeline(data.train, batch_size=8, micro_batches=2, layout=layout, seed=0)
    for item in pipeline:                            # core.data.DataBatch: .batch a PairBatch, .example_ids [P]
        ...

The rows (`data.source`, `data.format` prompt_completion or chat; see
`posttrain.dpo.pairs`) are tokenized and validated once, up front; the last
`data.eval_fraction` of the usable pairs is the eval split (`core.data.held_out`). The training split
is shuffled and repeated (a fresh permutation every epoch), `batch_size` pairs
per step, each step's pairs packed by `build_pair_batch` (the prompt once,
chosen and rejected as its branches) into `micro_batches` packing groups. The
iterator is Grain's, so its position is saved with a checkpoint and a resumed
run sees exactly the batches an uninterrupted one would. `example_ids` holds
each slot's source row (-1 for an empty slot).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grain
import numpy as np

from core.batch_source import Evaluation
from core.data import DataBatch, MalformedRow, epochs, held_out
from core.shapes import bucketed_width
from core.sources import DataSourceError
from posttrain.config import PostTrainConfig
from posttrain.dpo.pairs import Pair, PairBatch, build_pair_batch, tokenize_pairs


@dataclass
class PairData:
    train: list[Pair]
    eval: list[Pair]
    skipped: list[str] = field(default_factory=list)  # malformed rows left out (data.skip_malformed)
    dropped: list[str] = field(default_factory=list)  # pairs whose completions are identical once truncated


def load_pairs(cfg: PostTrainConfig, tokenizer: Any, records: Sequence[dict]) -> PairData:
    """Every usable pair of `records`, split into train and eval."""
    d = cfg.data
    source = d.source or "<records>"
    pairs, skipped, dropped = tokenize_pairs(
        records,
        tokenizer,
        data_format=d.format,
        seq_len=d.seq_len,
        max_prompt_tokens=cfg.dpo.max_prompt_tokens,
        max_completion_tokens=cfg.dpo.max_completion_tokens,
        skip_malformed=d.skip_malformed,
        source=source,
    )
    if not pairs:
        raise MalformedRow(f"{source}: no usable pairs ({len(skipped)} malformed, {len(dropped)} identical)")
    train, held = held_out(pairs, d.eval_fraction)
    if not train:
        raise DataSourceError(f"{source}: no training pairs left after data.eval_fraction={d.eval_fraction}")
    return PairData(train, held, skipped, dropped)


@dataclass(frozen=True)
class PairLayout:
    """How a batch's pairs sit in rows: `seq_len` tokens a row, several pairs a row (`pack`) or one, and row
    counts a multiple of `row_multiple` (the trainer's data-parallel size)."""

    seq_len: int
    pack: bool = True
    row_multiple: int = 1


def pair_batch(pairs: Sequence[Pair], *, slots: int, micro_batches: int, layout: PairLayout) -> DataBatch[PairBatch]:
    """`pairs` in a `PairBatch` of `slots` pair slots, its rows cut to what they hold: packed rows are
    `seq_len` long, one pair per row is as long as the longest pair (bucketed, `core.shapes.bucketed_width`)."""
    row_len = layout.seq_len if layout.pack else bucketed_width(max(p.length for p in pairs), layout.seq_len)
    batch = build_pair_batch(
        pairs,
        slots=slots,
        row_len=row_len,
        groups=micro_batches,
        pack=layout.pack,
        row_multiple=layout.row_multiple,
    )
    rows = np.full(slots, -1, np.int64)
    rows[: len(pairs)] = [p.row for p in pairs]
    return DataBatch(batch, rows)


def pair_pipeline(
    pairs: Sequence[Pair],
    *,
    batch_size: int,
    micro_batches: int,
    layout: PairLayout,
    seed: int,
    shuffle: bool = True,
) -> grain.IterDataset:
    """Training batches of `batch_size` pairs, shuffled and repeated forever, checkpointable."""
    if batch_size % micro_batches:
        raise ValueError(f"train.batch_size {batch_size} is not divisible by {micro_batches} micro-batches")
    return (
        epochs(len(pairs), seed=seed, shuffle=shuffle)
        .to_iter_dataset()
        .batch(batch_size, drop_remainder=True)
        .map(
            lambda idx: pair_batch(
                [pairs[int(i)] for i in idx], slots=batch_size, micro_batches=micro_batches, layout=layout
            )
        )
    )


def eval_batches(pairs: Sequence[Pair], *, batch_size: int, layout: PairLayout) -> Iterator[DataBatch[PairBatch]]:
    """`pairs` once, in order, `batch_size` pair slots per batch (the last one's unused slots empty)."""
    for start in range(0, len(pairs), batch_size):
        yield pair_batch(pairs[start : start + batch_size], slots=batch_size, micro_batches=1, layout=layout)


# What a method that trains on pairs (offline DPO, the reward model) reads of the config and the rows, once.

PAIR_FORMATS = {
    "prompt_completion": "prompt / chosen / rejected strings",
    "chat": "prompt messages, chosen / rejected one assistant message each",
}


def pair_texts(records: Sequence[dict]) -> Iterator[str]:
    """The text a run's tokenizer is trained on when it has none: every pair's prompt, chosen and rejected."""
    for r in records:
        for name in ("prompt", "chosen", "rejected"):
            if isinstance(r.get(name), str):
                yield r[name]


@dataclass
class PairSource:
    """A run's pairs (`load_pairs`), their layout, the training pipeline and the held-out batches (None: none)."""

    data: PairData
    layout: PairLayout
    train: grain.IterDataset
    evaluation: Evaluation | None
    notes: list[str]


def pair_source(cfg: PostTrainConfig, tokenizer: Any, records: Sequence[dict], row_multiple: int) -> PairSource:
    """The pairs of `records` as a run reads them: `train.batch_size` pairs a step in `train.micro_batches`
    packing groups, shuffled and repeated; every held-out pair once per evaluation."""
    data = load_pairs(cfg, tokenizer, records)
    layout = PairLayout(cfg.data.seq_len, cfg.data.packing, row_multiple=row_multiple)
    notes = [f"dropped {len(data.dropped)} pairs: {data.dropped[0]}"] if data.dropped else []
    size = cfg.train.batch_size
    train = pair_pipeline(
        data.train,
        batch_size=size,
        micro_batches=cfg.train.micro_batches,
        layout=layout,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    evaluation = Evaluation(lambda: eval_batches(data.eval, batch_size=size, layout=layout)) if data.eval else None
    return PairSource(data, layout, train, evaluation, notes)


def example_pair_batch(cfg: PostTrainConfig, row_multiple: int) -> PairBatch:
    """`train.batch_size` pairs whose prompt and completions are a third of `data.seq_len` each, packed as the
    pipeline packs pairs (what `train.compile_only` compiles an update for)."""
    rng = np.random.default_rng(0)
    third = cfg.data.seq_len // 3
    ids = lambda: tuple(int(x) for x in rng.integers(1, cfg.model.vocab_size, third))
    pairs = [Pair(i, ids(), ids(), ids()) for i in range(cfg.train.batch_size)]
    return build_pair_batch(
        pairs,
        slots=len(pairs),
        row_len=cfg.data.seq_len,
        groups=cfg.train.micro_batches,
        pack=cfg.data.packing,
        row_multiple=row_multiple,
    )
