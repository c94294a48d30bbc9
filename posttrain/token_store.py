"""Per-token values of a frozen model, computed once and stored next to the run, keyed by sequence and position.

    store = TokenStore.load_or_compute(path, digest, compute=lambda: {(row, 0): logp_chosen, (row, 1): ...})
    values = store.gather(keys, width=C)          # [len(keys), C] float32, 0 past a sequence's end / for None

A key names one scored sequence: (the source row it came from, which of that row's sequences) — a row of SFT
data holds one, a preference pair two (chosen 0, rejected 1). Its value is one float per target position, in
order (a reference model's log-prob of each target, say; a method sums them when it needs a sequence's total).
Precomputed values let a frozen model run over the data once, before training, and be released, so it never
shares memory with the learner and its optimizer (`dpo.precompute_ref_logps`).

The file (`.npz`: keys, offsets, values, fingerprint) is written whole or not at all. It is read back only when
its fingerprint equals the run's: a digest of the sequences' tokens and of the frozen model's weights
(`tokens_digest`, `weights_digest`), so a changed dataset or a changed checkpoint behind the same path is
recomputed (and said so), never reused stale.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from core.distributed import from_every_process, is_primary

Key = tuple[int, int]  # (source row, sequence within the row)


def tokens_digest(sequences: Iterable[tuple[int, Sequence[Sequence[int]]]]) -> str:
    """A digest of (row, token parts) entries, in order: the data the values were computed for."""
    h = hashlib.sha256()
    for row, parts in sequences:
        h.update(np.int64(row).tobytes())
        for part in parts:
            h.update(np.asarray(part, np.int32).tobytes())
            h.update(b"|")
    return h.hexdigest()


def weights_digest(params) -> str:
    """A digest of a model's weights (every parameter's path, dtype, shape and bytes, in tree order): the values a
    frozen model gives depend on what it holds, not on which path it was read from.

    Hashed from the shards this process's devices hold (one replica of each, with its place), then, in a process
    group, every process's digest together: no parameter is gathered. Another sharding gives another digest, so
    values stored under one mesh are recomputed under another, never reused wrongly."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape}".encode())
        own = [(s.index, s.data) for s in leaf.addressable_shards if s.replica_id == 0]
        for index, data in sorted(own, key=lambda item: [sl.indices(n)[0] for sl, n in zip(item[0], leaf.shape)]):
            h.update(repr([sl.indices(n)[:2] for sl, n in zip(index, leaf.shape)]).encode())
            h.update(np.ascontiguousarray(np.asarray(data)).tobytes())
    every = from_every_process(np.frombuffer(h.digest(), np.uint8))  # [processes, 32]
    return hashlib.sha256(every.tobytes()).hexdigest()


@dataclass
class TokenStore:
    values: dict[Key, np.ndarray]  # key -> [targets] float32
    path: Path | None = None  # the file it was read from or written to

    def gather(self, keys: Sequence[Key | None], width: int) -> np.ndarray:
        """[len(keys), width] float32: each key's values from position 0, zeros after them and for a None key (an
        empty slot). A key the store lacks is a `KeyError` naming it."""
        out = np.zeros((len(keys), width), np.float32)
        for i, key in enumerate(keys):
            if key is None:
                continue
            if key not in self.values:
                where = self.path or "the store"
                raise KeyError(f"{where}: no stored values for sequence {key} (row, sequence); delete it to recompute")
            v = self.values[key][:width]
            out[i, : len(v)] = v
        return out

    def save(self, path: Path, digest: str) -> None:
        keys = sorted(self.values)
        lengths = [len(self.values[k]) for k in keys]
        flat = np.concatenate([self.values[k] for k in keys]) if keys else np.zeros(0, np.float32)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            keys=np.asarray(keys, np.int64).reshape(-1, 2),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            values=flat.astype(np.float32),
            fingerprint=np.array(digest),
        )
        tmp.replace(path)  # whole or not at all: a kill mid-write leaves no half file

    @classmethod
    def load(cls, path: Path, digest: str) -> TokenStore | None:
        """The stored values when `path` exists and was computed for `digest`, else None."""
        if not path.exists():
            return None
        with np.load(path) as f:
            if str(f["fingerprint"]) != digest:
                print(f"{path}: computed for other data or other weights; recomputing", flush=True)
                return None
            keys, offsets, values = f["keys"], f["offsets"], f["values"]
            stored = {(int(r), int(s)): values[offsets[i] : offsets[i + 1]] for i, (r, s) in enumerate(keys)}
            return cls(stored, path)

    @classmethod
    def load_or_compute(cls, path: Path, digest: str, compute: Callable[[], dict[Key, np.ndarray]]) -> TokenStore:
        stored = cls.load(path, digest)
        if stored is not None:
            print(f"{path.name}: read {len(stored.values)} sequences' values from {path}", flush=True)
            return stored
        store = cls(compute(), path)  # in a process group every process computes (a collective)...
        if is_primary():  # ...and the first writes
            path.parent.mkdir(parents=True, exist_ok=True)
            store.save(path, digest)
        return store
