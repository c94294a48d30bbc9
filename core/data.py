"""Grain input pipelines: records -> tokens and targets -> packed `PackedBatch`es, with resumable state.

    pipeline = make_pipeline(cfg.data, batch_size=8, records=rows, tokenizer_dir=tok, micro_batches=2)
    for item in pipeline:            # DataBatch: .batch (a core.batch.PackedBatch), .example_ids
        learner.update(item.batch, micro_batches=2)

Sources (`data.source`):
- a local file: `.jsonl` / `.json` / `.parquet` / `.arrow`, read with Hugging Face `datasets`;
- a directory written by `datasets.Dataset.save_to_disk` (`load_from_disk`);
- `reasoning_gym:TASK` (e.g. `reasoning_gym:basic_arithmetic`): `data.num_examples`
  problems generated offline with seed `data.seed`;
- in Python, any list of dicts.

Formats (`data.format`) and their targets (the tokens a loss scores, each
predicted from the token before it):
- `text`: the `data.text_field` column plus EOS; every token after the first.
- `prompt_completion`: `prompt` + `completion` strings plus EOS; the completion
  and its EOS (every token after the first without `completion_only_loss`).
- `chat`: a `messages` list rendered with the tokenizer's own chat template;
  every assistant turn with its end-of-turn token (`core.chat.render_chat`:
  spans found by rendering prefix by prefix, any template).

Every row is tokenized and validated once, up front. A row that cannot be used
(missing field, wrong type, empty text, a template that cannot render it, or
no target left after truncating to `data.seq_len` on `data.truncation_side`)
raises `MalformedRow` naming the source, row index and what is wrong, or, with
`data.skip_malformed`, is skipped and counted (`Pipeline.skipped`).

Batches are `DataBatch`es: a `PackedBatch` with one scored sequence per row
(its targets packed to the left of `[B, C]`, C <= seq_len, `target_index` local to
each of `micro_batches` groups of rows) and `example_ids` `[B, L]` (the source
row of every token, -1 on padding). With `data.packing` several examples share
a row (Grain's first-fit packer), each with its own segment and positions; no
token attends across examples. With `data.padding_free` (and no packing) each
step still takes `batch_size` examples, but lays them first-fit decreasing into
the fewest rows of `data.seq_len` (`core.packing.pack_rows`, segments as with
packing), so the model runs on the examples' tokens rather than on rows padded
to the longest: the same examples, loss and gradient as padded rows, in fewer
rows. The iterator's state (`get_state` / `set_state`, or Orbax via
`grain.checkpoint`) restores to the exact next batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grain
import numpy as np

from core.batch import PackedBatch
from core.config import DataConfig
from core.errors import MissingPath, UserError
from core.packing import Segment, pack_rows, round_up
from core.shapes import bucketed_width


class DataSourceError(UserError, ValueError):
    """A data source that cannot be read at all (unsupported type, unreadable file)."""


class MalformedRow(UserError, ValueError):
    """A dataset row that cannot be used; the message names the source, row and field."""


# ------------------------------------------------------------------ sources


def load_records(source: str | Sequence[dict], cfg: DataConfig) -> Sequence[dict]:
    """Rows of a source as a random-access sequence of dicts."""
    if not isinstance(source, str):
        return list(source)
    if source.startswith("reasoning_gym:"):
        return reasoning_gym_records(source.split(":", 1)[1], cfg.num_examples, cfg.seed)
    import datasets

    path = Path(source)
    if not path.exists():
        raise MissingPath(f"data.source {source!r}: no such file or directory")
    if path.is_dir():
        if (
            (path / "dataset_info.json").exists()
            or (path / "state.json").exists()
            or (path / "dataset_dict.json").exists()
        ):
            ds = datasets.load_from_disk(str(path))
            return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        raise DataSourceError(f"data.source {source!r} is a directory but not a `save_to_disk` dataset")
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
    if path.suffix not in builders:
        raise DataSourceError(f"data.source {source!r}: unsupported file type {path.suffix!r}; use {sorted(builders)}")
    try:
        return datasets.load_dataset(builders[path.suffix], data_files=str(path), split="train")
    except Exception as err:
        cause = err.__cause__ or err
        raise DataSourceError(
            f"data.source {source!r}: cannot be read as {builders[path.suffix]} "
            f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
        ) from None


def reasoning_gym_records(task: str, size: int, seed: int, **task_options: Any) -> list[dict]:
    """Problems generated offline by reasoning-gym: question, answer, the task's metadata as JSON (the
    `reasoning_gym` reward scores with the task's own checker from it), and the problem in every
    `data.format`: `text`, `prompt` / `completion`, a system + user + assistant `messages` chat, and a
    preference pair (`prompt`, `chosen` = the completion, `rejected` = a near miss, `near_miss`).
    `task_options` go to the task's dataset config (e.g. `max_digits=2`)."""
    import random

    import reasoning_gym

    ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_options)
    rng = random.Random(seed)
    return [
        {
            "question": e["question"],
            "answer": str(e["answer"]),
            "text": f"{e['question']}\nAnswer: {e['answer']}",
            "prompt": f"{e['question']}\nAnswer:",
            "completion": f" {e['answer']}",
            "messages": [
                {"role": "system", "content": "Reply with the answer only."},
                {"role": "user", "content": e["question"]},
                {"role": "assistant", "content": str(e["answer"])},
            ],
            "chosen": f" {e['answer']}",
            "rejected": f" {near_miss(str(e['answer']), rng)}",
            "metadata": json.dumps(e["metadata"], default=str),
        }
        for e in ds
    ]


def near_miss(answer: str, rng: Any) -> str:
    """A wrong answer close to `answer`: an integer off by 1, 2 or 10, or with its sign lost; anything else
    with a digit appended."""
    try:
        value = int(answer)
    except ValueError:
        return answer + "0"
    if value < 0 and rng.random() < 0.5:
        return str(-value)
    return str(value + rng.choice([-10, -2, -1, 1, 2, 10]))


# --------------------------------------------------------------- validation


def _problem(row: Any, cfg: DataConfig) -> tuple[str, str] | None:
    """(field, what is wrong) for a malformed row, or None."""
    if not isinstance(row, dict):
        return "<row>", f"expected a mapping, got {type(row).__name__}"
    if cfg.format == "text":
        fields = [cfg.text_field]
    elif cfg.format == "prompt_completion":
        fields = ["prompt", "completion"]
    else:
        msgs = row.get("messages")
        if msgs is None:
            return "messages", "missing"
        if not isinstance(msgs, list) or not msgs:
            return "messages", f"expected a non-empty list, got {type(msgs).__name__}"
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"messages[{j}]", "expected {role: str, content: str}"
        return None
    for name in fields:
        if name not in row or row[name] is None:
            return name, "missing"
        if not isinstance(row[name], str):
            return name, f"expected a string, got {type(row[name]).__name__}"
        if not row[name].strip():
            return name, "empty text"
    return None


def validate(records: Sequence[dict], cfg: DataConfig, source: str) -> tuple[list[int], list[str]]:
    """Indices of usable rows and a description of each skipped one (raises unless skipping)."""
    keep, skipped = [], []
    for i in range(len(records)):
        bad = _problem(records[i], cfg)
        if bad is None:
            keep.append(i)
            continue
        message = f"{source}: row {i}: field '{bad[0]}': {bad[1]}"
        if not cfg.skip_malformed:
            raise MalformedRow(message + " (set data.skip_malformed=true to skip such rows)")
        skipped.append(message)
    if not keep:
        raise MalformedRow(f"{source}: no usable rows ({len(skipped)} malformed)")
    return keep, skipped


# ---------------------------------------------------------------- tokenising


@dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # [n] int32
    targets: np.ndarray  # [n] int32: 1 where the token is a target (never at position 0)


def _load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    if not Path(tokenizer_dir).is_dir():
        raise MissingPath(f"data.tokenizer_dir {tokenizer_dir!r}: no such directory")
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def token_targets(row: dict, tok: Any, cfg: DataConfig, completion_only: bool) -> tuple[list[int], list[int]]:
    """(token ids, target positions) of one row in `cfg.format`, before truncation."""
    if cfg.format == "text":
        ids = tok(row[cfg.text_field], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return ids, list(range(1, len(ids)))
    if cfg.format == "prompt_completion":
        prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = prompt + completion
        first = len(prompt) if completion_only else 1
        return ids, list(range(max(first, 1), len(ids)))
    from core.chat import render_chat

    ids, targets = render_chat(tok, row["messages"])
    return ids, targets if completion_only else list(range(1, len(ids)))


def truncate(ids: list[int], targets: list[int], length: int, side: str) -> tuple[list[int], list[int]]:
    """At most `length` tokens, cut on the right or the left; a target needs the token before it, so a target that
    becomes the first token is dropped."""
    if len(ids) <= length:
        return ids, targets
    if side == "right":
        return ids[:length], [k for k in targets if k < length]
    cut = len(ids) - length
    return ids[cut:], [k - cut for k in targets if k - cut >= 1]


def tokenize_rows(
    records: Sequence[dict], keep: Sequence[int], tok: Any, cfg: DataConfig, completion_only: bool, source: str
) -> tuple[dict[int, Example], list[str]]:
    """Every kept row as an `Example` (by row index), and a description of each row skipped for having no target
    (raises unless `data.skip_malformed`)."""
    from core.chat import ChatTemplateError

    examples, skipped = {}, []
    for i in keep:
        try:
            ids, targets = token_targets(records[i], tok, cfg, completion_only)
            problem = None
        except ChatTemplateError as err:
            problem = f"chat template: {err}"
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
        examples[i] = Example(np.asarray(ids, np.int32), mask)
    return examples, skipped


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
class DataBatch:
    """A pipeline's item: what the model trains on, and where it came from."""

    # A PackedBatch, or a method's batch holding one (posttrain.pairs.PairBatch); `.tokens` is [R, L] either way.
    batch: Any
    # The source row of every token, -1 on padding ([B, L]); for pair batches, of every pair slot ([P]).
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
    packed = PackedBatch(tokens, rows["positions"], seg, np.zeros_like(tokens), index, ids, mask)
    return DataBatch(packed, rows["example_ids"])


# ---------------------------------------------------------------- pipelines


@dataclass
class Pipeline:
    """A batched Grain dataset plus what validation found."""

    dataset: grain.IterDataset
    num_rows: int
    skipped: list[str] = field(default_factory=list)

    def __iter__(self):
        return iter(self.dataset)


def make_pipeline(
    cfg: DataConfig,
    batch_size: int,
    *,
    records: Sequence[dict] | None = None,
    tokenizer_dir: str | None = None,
    split: str = "train",
    completion_only: bool = True,
    micro_batches: int = 1,
    row_multiple: int = 1,
    process_index: int = 0,
    process_count: int = 1,
) -> Pipeline:
    """Training split: shuffled, repeated forever, packed or padded. Eval split: one pass, in order.

    `data.eval_fraction` of the rows (the last ones) form the eval split.
    Rows are sharded across JAX processes (`process_index::process_count`)
    after validation, so every process sees a disjoint part. `micro_batches`
    is the train step's: target indices are local to each micro-batch. With
    `data.padding_free` a micro-batch's row count is a multiple of
    `row_multiple` (the data-parallel size, so that rows split evenly).
    """
    source = cfg.source or "<records>"
    if records is None:
        if cfg.source is None:
            raise DataSourceError("data.source is not set")
        records = load_records(cfg.source, cfg)
    tokenizer_dir = tokenizer_dir or cfg.tokenizer_dir
    if tokenizer_dir is None:
        raise DataSourceError("data.tokenizer_dir is not set")
    if batch_size % micro_batches:
        raise ValueError(f"batch size {batch_size} is not divisible by {micro_batches} micro-batches")
    keep, skipped = validate(records, cfg, str(source))
    n_eval = round(cfg.eval_fraction * len(keep))
    keep = keep[len(keep) - n_eval :] if split == "eval" else keep[: len(keep) - n_eval]
    keep = keep[process_index::process_count]
    if not keep:
        raise DataSourceError(f"{source}: the {split} split is empty (eval_fraction={cfg.eval_fraction})")
    examples, no_targets = tokenize_rows(records, keep, _load_tokenizer(tokenizer_dir), cfg, completion_only, source)
    skipped += no_targets
    usable = sorted(examples)
    if not usable:
        raise MalformedRow(f"{source}: no usable rows in the {split} split ({len(skipped)} malformed)")

    ds = grain.MapDataset.source(usable)
    if split == "train":
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        ds = ds.repeat(None)  # after shuffle: every epoch gets a fresh permutation
    it = ds.map(lambda i: _element(i, examples[i])).to_iter_dataset()
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
    return Pipeline(it, len(usable), skipped)
