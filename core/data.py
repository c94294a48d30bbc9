"""Grain input pipelines: records -> tokens -> packed or padded batches, with resumable state.

Sources (`data.source`):
- a local file: `.jsonl` / `.json` / `.parquet` / `.arrow`, read with Hugging Face `datasets`;
- a directory written by `datasets.Dataset.save_to_disk` (`load_from_disk`);
- `reasoning_gym:TASK` (e.g. `reasoning_gym:basic_arithmetic`): `data.num_examples`
  problems generated offline with seed `data.seed`;
- in Python, any list of dicts.

Formats (`data.format`): `text` (the `data.text_field` column), `chat` (a
`messages` list, tokenised with the tokenizer's chat template; with
`sft.completion_only_loss` only assistant tokens carry loss), `prompt_completion`
(`prompt` + `completion` strings; loss on the completion).

Every row is validated once, up front: a malformed row (missing field, wrong
type, empty text) raises `MalformedRow` naming the source, row index and field,
or, with `data.skip_malformed`, is skipped and counted (`Pipeline.skipped`).

Batches are dicts of numpy arrays `[B, T]`: `tokens`, `segment_ids` (0 =
padding; packed documents 1, 2, ...), `positions` (restarting per document),
`loss_mask` (1 where the token is a target of training) and `example_ids`
(source row of every token, -1 on padding). The iterator's state
(`get_state` / `set_state`, or Orbax via `grain.checkpoint`) restores to the
exact next batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grain
import numpy as np

from core.config import DataConfig
from core.errors import MissingPath, UserError


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
    """Problems generated offline by reasoning-gym: question, answer, a `text` rendering, and the
    task's metadata as JSON (the `reasoning_gym` reward scores with the task's own checker from it).
    `task_options` go to the task's dataset config (e.g. `max_digits=2`)."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_options)
    return [
        {
            "question": e["question"],
            "answer": str(e["answer"]),
            "text": f"{e['question']}\nAnswer: {e['answer']}",
            "metadata": json.dumps(e["metadata"], default=str),
        }
        for e in ds
    ]


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


class Tokenize(grain.transforms.Map):
    """Row -> {tokens, loss_mask, example_ids}, truncated to `seq_len`."""

    def __init__(self, tokenizer_dir: str, cfg: DataConfig, completion_only: bool):
        self.tokenizer_dir = tokenizer_dir
        self.cfg = cfg
        self.completion_only = completion_only
        # Loaded here, in the calling thread: transformers' lazy imports are not safe to
        # trigger first from Grain's prefetch threads.
        self._tok = _load_tokenizer(tokenizer_dir)

    def __getstate__(self):  # pickles cheaply into worker processes; reloaded there
        return {**self.__dict__, "_tok": None}

    @property
    def tok(self):
        if self._tok is None:
            self._tok = _load_tokenizer(self.tokenizer_dir)
        return self._tok

    def map(self, element: tuple[int, dict]) -> dict[str, np.ndarray]:
        index, row = element
        tok, cfg = self.tok, self.cfg
        if cfg.format == "text":
            ids = tok(row[cfg.text_field], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            mask = [1] * len(ids)
        elif cfg.format == "prompt_completion":
            prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
            completion = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = prompt + completion
            mask = ([0] * len(prompt) if self.completion_only else [1] * len(prompt)) + [1] * len(completion)
        else:
            out = tok.apply_chat_template(
                row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = list(out["input_ids"])
            mask = list(out["assistant_masks"]) if self.completion_only else [1] * len(ids)
        n = min(len(ids), cfg.seq_len)
        return {
            "tokens": np.asarray(ids[:n], np.int32),
            "loss_mask": np.asarray(mask[:n], np.int32),
            "example_ids": np.full((n,), index, np.int32),
        }


def _load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    if not Path(tokenizer_dir).is_dir():
        raise MissingPath(f"data.tokenizer_dir {tokenizer_dir!r}: no such directory")
    return AutoTokenizer.from_pretrained(tokenizer_dir)


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


def _from_packed(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = batch["tokens_segment_ids"].astype(np.int32)
    return {
        "tokens": batch["tokens"].astype(np.int32),
        "segment_ids": seg,
        "positions": batch["tokens_positions"].astype(np.int32),
        "loss_mask": np.where(seg > 0, batch["loss_mask"], 0).astype(np.int32),
        "example_ids": np.where(seg > 0, batch["example_ids"], -1).astype(np.int32),
    }


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
    process_index: int = 0,
    process_count: int = 1,
) -> Pipeline:
    """Training split: shuffled, repeated forever, packed or padded. Eval split: one pass, in order.

    `data.eval_fraction` of the rows (the last ones) form the eval split.
    Rows are sharded across JAX processes (`process_index::process_count`)
    after validation, so every process sees a disjoint part.
    """
    source = cfg.source or "<records>"
    if records is None:
        if cfg.source is None:
            raise DataSourceError("data.source is not set")
        records = load_records(cfg.source, cfg)
    tokenizer_dir = tokenizer_dir or cfg.tokenizer_dir
    if tokenizer_dir is None:
        raise DataSourceError("data.tokenizer_dir is not set")
    keep, skipped = validate(records, cfg, str(source))
    n_eval = round(cfg.eval_fraction * len(keep))
    keep = keep[len(keep) - n_eval :] if split == "eval" else keep[: len(keep) - n_eval]
    keep = keep[process_index::process_count]
    if not keep:
        raise DataSourceError(f"{source}: the {split} split is empty (eval_fraction={cfg.eval_fraction})")

    ds = grain.MapDataset.source(keep).map(lambda i: (i, records[i]))
    if split == "train":
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        ds = ds.repeat(None)  # after shuffle: every epoch gets a fresh permutation
    ds = ds.map(Tokenize(tokenizer_dir, cfg, completion_only))
    it = ds.to_iter_dataset()
    if cfg.packing and split == "train":
        lengths = {"tokens": cfg.seq_len, "loss_mask": cfg.seq_len, "example_ids": cfg.seq_len}
        it = grain.experimental.FirstFitPackIterDataset(
            it, length_struct=lengths, num_packing_bins=batch_size, shuffle_bins=False
        )
        it = it.batch(batch_size, drop_remainder=True).map(_from_packed)
    else:
        it = it.map(lambda e: _pad_row(e, cfg.seq_len)).batch(batch_size, drop_remainder=split == "train")
    return Pipeline(it, len(keep), skipped)
