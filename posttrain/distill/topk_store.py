"""A teacher's top-k next-token distribution at every target of a dataset, on disk: offline distillation's input.

    plan = DumpPlan.of(header, examples)                           # which rows go in which shard
    todo = start_dump(directory, plan, examples)                    # the shards still to write (resume)
    write_shard(directory, plan, i, examples, ids, logp, counts)    # one shard, atomically; the index updated
    store = TopKStore.open(directory, data, student_vocab, examples)    # checked against the run's data
    ids, logp = store.gather(example_ids, positions, slots)         # [B, C, k] for a batch's target slots

Layout of `directory` (written by `python -m recipes.distill_logits`):

    index.json             the header (format, k, dtype, temperature, teacher, vocabulary size and digest of the
                           tokenizer, sequence length, data source and format) and one entry per finished shard:
                           {stem, rows, targets, digest}
    shard-00000-ids.npy    int32 [targets, k]: the teacher's k most likely next tokens, most likely first
    shard-00000-logp.npy   [targets, k] their log-probs over the whole vocabulary at the dump's temperature
                           (float32, float16, or bfloat16 stored as its uint16 bits)
    shard-00000-rows.npy   int64 [rows, 3]: (source row, first target in this shard, its number of targets)

A shard holds `rows_per_shard` consecutive usable rows (in source order) and, for each, one entry per target of its
tokenization in order (what `core.data.tokenize_examples` makes of the row: SFT's targets). Every file is written
to a temporary name and renamed, the index last, so a killed dump leaves whole shards and resumes at the first one
the index lacks. A shard's `digest` covers its rows' tokens and targets: when the data, the tokenizer, the
truncation or the sequence length changes, the shard no longer matches and opening the store is an error naming it
(as is a header whose data settings differ: another tokenizer, sequence length, truncation side, source or format,
`DATA_KEYS`). A training run reads k, dtype, temperature and shard size from the index; a resumed dump must have
the same ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from core.data import Examples
from core.errors import TemperError
from posttrain.token_store import tokens_digest

FORMAT = "temper-topk-v1"
INDEX = "index.json"
# What ties a dump to a run's rows: a training run must agree on these (the rest it reads from the index).
DATA_KEYS = ("format", "tokenizer", "seq_len", "truncation_side", "source", "data_format")


class TopKStoreMismatch(TemperError, ValueError):
    """A dump that does not belong to this run's data or settings (the message names the shard or key)."""


@dataclass(frozen=True)
class DumpHeader:
    """What a dump was made with: a training run must agree on `DATA_KEYS` (it reads the rest from the index), a
    resumed dump on all but the teacher."""

    k: int
    dtype: str  # float32 | float16 | bfloat16
    temperature: float
    teacher: str
    vocab_size: int  # the teacher's ids are below it: its rows, at most the tokenizer's length
    tokenizer: str  # a digest of the tokenizer's vocabulary
    seq_len: int
    truncation_side: str
    source: str
    data_format: str
    rows_per_shard: int
    format: str = FORMAT


def tokenizer_digest(tokenizer) -> str:
    """A digest of a tokenizer's vocabulary (its tokens in id order) and its special tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return _text_digest([t for t, _ in vocab] + ["|"] + sorted(str(t) for t in tokenizer.all_special_tokens))


def _text_digest(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


@dataclass(frozen=True)
class DumpPlan:
    """The shards of a dump: every usable row of the data (training and held-out), in source order, cut into
    consecutive runs of `header.rows_per_shard`."""

    header: DumpHeader
    shards: list[list[int]]  # shard i -> its source rows

    @classmethod
    def of(cls, header: DumpHeader, examples: Examples) -> DumpPlan:
        rows = sorted(examples.by_row)
        n = header.rows_per_shard
        return cls(header, [rows[i : i + n] for i in range(0, len(rows), n)])

    @staticmethod
    def stem(i: int) -> str:
        return f"shard-{i:05d}"

    def digest(self, i: int, examples: Examples) -> str:
        return tokens_digest(
            (r, [examples.by_row[r].tokens.tolist(), examples.by_row[r].targets.astype(np.int32).tolist()])
            for r in self.shards[i]
        )


def read_index(directory: str | Path) -> dict | None:
    path = Path(directory) / INDEX
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def _to_stored(logp: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # NumPy has no bfloat16: keep its bits (round to nearest even)
        bits = np.asarray(logp, np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.asarray(logp, dtype)


def _from_stored(stored: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


def start_dump(directory: str | Path, plan: DumpPlan, examples: Examples) -> list[int]:
    """Create or resume a dump in `directory`; the shards still to write. An existing index must have the same
    header, and each shard it lists the digest of the same rows now: else a `TopKStoreMismatch` naming it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = read_index(directory)
    if index is None:
        _write_index(directory, {"header": asdict(plan.header), "shards": []})
        return list(range(len(plan.shards)))
    want = {k: v for k, v in asdict(plan.header).items() if k != "teacher"}  # a resumed dump: the same settings
    _check_header(directory, index, want)
    done = {s["stem"] for s in index["shards"]}
    for entry in index["shards"]:
        _check_shard(directory, entry, plan, examples)
    return [i for i in range(len(plan.shards)) if plan.stem(i) not in done]


def write_shard(
    directory: str | Path,
    plan: DumpPlan,
    i: int,
    examples: Examples,
    ids: np.ndarray,
    logp: np.ndarray,
    counts: Sequence[int],
) -> None:
    """Shard i: `ids` / `logp` [targets, k] of its rows in order, `counts` targets each."""
    directory = Path(directory)
    rows = plan.shards[i]
    if len(counts) != len(rows) or sum(counts) != len(ids):
        raise ValueError(f"shard {i}: {len(counts)} rows with {sum(counts)} targets for {len(rows)} rows, {len(ids)}")
    stem = plan.stem(i)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    _atomic_save(directory / f"{stem}-ids.npy", np.asarray(ids, np.int32))
    _atomic_save(directory / f"{stem}-logp.npy", _to_stored(logp, plan.header.dtype))
    _atomic_save(directory / f"{stem}-rows.npy", np.stack([np.asarray(rows), starts, np.asarray(counts)], 1))
    index = read_index(directory) or {"header": asdict(plan.header), "shards": []}
    entry = {"stem": stem, "rows": len(rows), "targets": int(sum(counts)), "digest": plan.digest(i, examples)}
    index["shards"] = [s for s in index["shards"] if s["stem"] != stem] + [entry]
    _write_index(directory, index)


def _write_index(directory: Path, index: dict) -> None:
    tmp = directory / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, directory / INDEX)


def _check_header(directory: Path, index: dict, want: dict) -> None:
    saved = index.get("header", {})
    for key, value in want.items():
        if saved.get(key) != value:
            raise TopKStoreMismatch(
                f"{directory / INDEX}: the dump was made with {key}={saved.get(key)!r}, this run has {value!r} "
                f"(dump again into another distill.logits_dir, or use the settings it was made with)"
            )


def _check_shard(directory: Path, entry: dict, plan: DumpPlan, examples: Examples) -> None:
    stem = entry["stem"]
    i = int(stem.rsplit("-", 1)[1])
    if i >= len(plan.shards) or plan.digest(i, examples) != entry["digest"]:
        rows = plan.shards[i] if i < len(plan.shards) else []
        what = f"rows {rows[0]}..{rows[-1]}" if rows else "no rows of this data"
        raise TopKStoreMismatch(
            f"{directory / stem}: written for other data than this run's {what} (the rows, the tokenizer or the "
            f"sequence length changed since it was dumped): dump again into an empty distill.logits_dir"
        )
    for part in ("ids", "logp", "rows"):
        if not (directory / f"{stem}-{part}.npy").exists():
            raise TopKStoreMismatch(f"{directory / stem}-{part}.npy: listed in {INDEX} but missing")


@dataclass
class TopKStore:
    """A finished dump, read (memory-mapped) and indexed by (source row, target ordinal)."""

    header: DumpHeader
    ids: list[np.ndarray]  # per shard [targets, k]
    logp: list[np.ndarray]
    where: dict[int, tuple[int, int, int]]  # source row -> (shard, first target, targets)
    ordinal: dict[int, np.ndarray]  # source row -> [tokens] the target ordinal at each position (-1: none)

    @classmethod
    def open(cls, directory: str | Path, data: dict, student_vocab: int, examples: Examples) -> TopKStore:
        """The dump in `directory`, checked against the run's data settings (`data`: `DATA_KEYS`), its student's
        vocabulary and its `examples`: every usable row is in a shard whose digest matches (else
        `TopKStoreMismatch` naming the shard, or the missing rows)."""
        directory = Path(directory)
        index = read_index(directory)
        if index is None:
            raise TopKStoreMismatch(
                f"{directory}: no {INDEX} (write the teacher's top-k first: python -m recipes.distill_logits)"
            )
        _check_header(directory, index, {k: data[k] for k in DATA_KEYS})
        header = DumpHeader(**index["header"])
        if header.vocab_size > student_vocab:
            raise TopKStoreMismatch(
                f"{directory / INDEX}: the teacher's ids range over {header.vocab_size} tokens, more than the "
                f"student's vocabulary of {student_vocab}: not the same tokenizer"
            )
        plan = DumpPlan.of(header, examples)
        done = {s["stem"]: s for s in index["shards"]}
        missing = [plan.stem(i) for i in range(len(plan.shards)) if plan.stem(i) not in done]
        if missing:
            raise TopKStoreMismatch(
                f"{directory}: {len(missing)} of {len(plan.shards)} shards not written yet (first: {missing[0]}); "
                f"finish the dump (python -m recipes.distill_logits resumes it)"
            )
        ids, logp, where = [], [], {}
        for i in range(len(plan.shards)):
            _check_shard(directory, done[plan.stem(i)], plan, examples)
            stem = directory / plan.stem(i)
            ids.append(np.load(f"{stem}-ids.npy", mmap_mode="r"))
            logp.append(np.load(f"{stem}-logp.npy", mmap_mode="r"))
            for row, start, count in np.load(f"{stem}-rows.npy"):
                where[int(row)] = (i, int(start), int(count))
        ordinal = {}
        for row, ex in examples.by_row.items():
            targets = np.asarray(ex.targets) > 0
            ordinal[row] = np.where(targets, np.cumsum(targets) - 1, -1)
        return cls(header, ids, logp, where, ordinal)

    def gather(self, example_ids: np.ndarray, positions: np.ndarray, token_at: np.ndarray) -> tuple[np.ndarray, ...]:
        """The top-k of a batch's target slots: `token_at` [B, C] is the row position of the token each slot
        predicts (-1: an empty slot), `example_ids` / `positions` [B, L] the batch's. -> ([B, C, k] int32 ids,
        [B, C, k] float32 log-probs), zeros on empty slots."""
        b, c = token_at.shape
        k = self.header.k
        ids = np.zeros((b, c, k), np.int32)
        logp = np.zeros((b, c, k), np.float32)
        for r in range(b):
            for j in np.flatnonzero(token_at[r] >= 0):
                t = token_at[r, j]
                row, pos = int(example_ids[r, t]), int(positions[r, t])
                shard, start, count = self.where[row]
                n = int(self.ordinal[row][pos])
                if not 0 <= n < count:
                    raise TopKStoreMismatch(f"row {row}, position {pos}: not a target the dump holds ({count})")
                ids[r, j] = self.ids[shard][start + n]
                logp[r, j] = _from_stored(np.asarray(self.logp[shard][start + n]), self.header.dtype)
        return ids, logp
