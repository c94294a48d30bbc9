"""Where a run's rows come from: `data.source` read into a random-access sequence of dicts.

    records = load_records(cfg.data)          # every row of data.source, with data.columns applied

Sources (`data.source`):
- a local file: `.jsonl` / `.json` / `.parquet` / `.arrow`, read with Hugging Face `datasets`;
- a local directory: one written by `datasets.Dataset.save_to_disk`, or a dataset repository's files
  (`datasets.load_dataset(dir, data.subset, split=data.split)`);
- a Hugging Face Hub dataset id (`trl-lib/ultrafeedback_binarized`), resolved through the Hub cache
  (`core.hf.hub`; offline with `HF_HUB_OFFLINE=1`), then read as a directory; a local path of that name wins;
- `reasoning_gym:TASK` (e.g. `reasoning_gym:basic_arithmetic`): `data.num_examples` problems generated offline
  with seed `data.seed`;
- in Python, any list of dicts.
`data.columns` takes a field from another column (`{messages: conversations}`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from core.config import DataConfig
from core.errors import MissingPath, UserError


class DataSourceError(UserError, ValueError):
    """A data source that cannot be read at all (unsupported type, unreadable file)."""


def load_records(cfg: DataConfig, source: str | Sequence[dict] | None = None) -> Sequence[dict]:
    """The rows of `source` (default `data.source`) as a random-access sequence of dicts, with `data.columns`
    applied."""
    source = cfg.source if source is None else source
    if source is None:
        raise DataSourceError("data.source is not set")
    rows = _read_source(source, cfg)
    return _with_columns(rows, cfg.columns, str(source) if isinstance(source, str) else "<records>")


def _read_source(source: str | Sequence[dict], cfg: DataConfig) -> Sequence[dict]:
    if not isinstance(source, str):
        return list(source)
    if source.startswith("reasoning_gym:"):
        return reasoning_gym_records(source.split(":", 1)[1], cfg.num_examples, cfg.seed)
    import datasets

    from core.hf.hub import resolve_dataset

    path = resolve_dataset(source)
    if not path.exists():
        raise MissingPath(f"data.source {source!r}: no such file or directory (and not a Hugging Face Hub id)")
    if path.is_dir():
        if any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(path))
            return ds[cfg.split] if isinstance(ds, datasets.DatasetDict) else ds
        return _read(lambda: datasets.load_dataset(str(path), cfg.subset, split=cfg.split), source, "a dataset")
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
    if path.suffix not in builders:
        raise DataSourceError(f"data.source {source!r}: unsupported file type {path.suffix!r}; use {sorted(builders)}")
    builder = builders[path.suffix]
    return _read(lambda: datasets.load_dataset(builder, data_files=str(path), split="train"), source, builder)


def _read(load, source: str, what: str):
    # `datasets` logs its own traceback at ERROR before raising; the error below says what was wrong in one line.
    # (Its warnings on a load that succeeds are silenced too: a trade for errors a user can read.)
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return load()
    except Exception as err:
        cause = err.__cause__ or err
        raise DataSourceError(
            f"data.source {source!r}: cannot be read as {what} "
            f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
        ) from None
    finally:
        logger.setLevel(level)


def _with_columns(rows: Sequence[dict], columns: dict[str, str], source: str) -> Sequence[dict]:
    """Every row with field `ours` taken from column `theirs`, for each `ours: theirs` of `data.columns`."""
    if not columns:
        return rows
    names = getattr(rows, "column_names", None) or (sorted(rows[0]) if len(rows) else [])
    missing = [theirs for theirs in columns.values() if theirs not in names]
    if missing:
        raise DataSourceError(
            f"data.source {source!r}: data.columns names {missing}, which the rows do not have (columns: {names}); "
            f"set data.columns to map the rows' own columns, or data.columns={{}} when they already hold the fields"
        )
    return _Renamed(rows, columns)


class _Renamed(Sequence):
    """A read-only view of rows with fields copied from other columns (`data.columns`)."""

    def __init__(self, rows: Sequence[dict], columns: dict[str, str]):
        self.rows, self.columns = rows, columns

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        row = dict(self.rows[i])
        for ours, theirs in self.columns.items():
            row[ours] = row[theirs]
        return row


def reasoning_gym_records(task: str, size: int, seed: int, **task_options: Any) -> list[dict]:
    """Problems generated offline by reasoning-gym: question, answer, the task's metadata as JSON (the
    `reasoning_gym` reward scores with the task's own checker from it), and the problem in every
    `data.format`: `text`, `prompt` / `completion`, a system + user + assistant `messages` chat, and a wrong
    completion close to the right one (`wrong_completion`, a near miss: e.g. the rejected side of a preference
    pair, `data.columns={chosen: completion, rejected: wrong_completion}`).
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
            "wrong_completion": f" {near_miss(str(e['answer']), rng)}",
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
