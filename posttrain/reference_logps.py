"""The reference model's summed log-probs of every pair, computed once and stored next to the run.

    store = ReferenceLogps.load_or_compute(path, pairs, fingerprint, compute=lambda: ...)
    batch = store.attach(data_batch)          # the PairBatch with ref_chosen / ref_rejected filled in

With `dpo.precompute_ref_logps` the reference runs over the whole dataset
(train and eval pairs) before the first step and is then released, so it never
shares memory with the policy and its optimizer. The values go to
`run_dir/reference_logps.npz` with a fingerprint of the pairs' tokens and of
where the reference came from; a resumed run with the same fingerprint reads
them back instead of loading the reference at all, and a run whose data or
reference changed recomputes them (saying so).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.data import DataBatch
from posttrain.frozen import FrozenModel
from posttrain.pair_data import PairLayout, eval_batches
from posttrain.pairs import Pair, PairBatch


def fingerprint(pairs: Sequence[Pair], reference: str) -> str:
    """A digest of every pair's tokens, in order, and of the reference's origin."""
    h = hashlib.sha256(reference.encode())
    for p in pairs:
        for part in (p.prompt, p.chosen, p.rejected):
            h.update(np.asarray(part, np.int32).tobytes())
            h.update(b"|")
        h.update(np.int64(p.row).tobytes())
    return h.hexdigest()


def compute_reference_logps(
    pairs: Sequence[Pair], reference: FrozenModel, *, batch_size: int, layout: PairLayout
) -> dict[int, tuple[float, float]]:
    """{source row: (chosen, rejected) summed reference log-probs} over `pairs`, `batch_size` pairs a pass."""
    out: dict[int, tuple[float, float]] = {}
    for n, item in enumerate(eval_batches(pairs, batch_size=batch_size, layout=layout)):
        seq = reference.logprobs(item.batch.packed, groups=1).sum(axis=-1)
        for i, row in enumerate(item.example_ids):
            if row >= 0:
                out[int(row)] = (float(seq[2 * i]), float(seq[2 * i + 1]))
        if (n + 1) % 20 == 0 or len(out) == len(pairs):
            print(f"reference log-probs: {len(out)}/{len(pairs)} pairs", flush=True)
    return out


@dataclass
class ReferenceLogps:
    by_row: dict[int, tuple[float, float]]

    def attach(self, data: DataBatch) -> PairBatch:
        """`data`'s pair batch with the stored reference log-probs of its pairs (0 for an empty slot)."""
        rows = np.asarray(data.example_ids)
        values = np.array([self.by_row[int(r)] if r >= 0 else (0.0, 0.0) for r in rows], np.float32)
        return data.batch.replace(ref_chosen=values[:, 0], ref_rejected=values[:, 1])

    def save(self, path: Path, digest: str) -> None:
        rows = np.array(sorted(self.by_row), np.int64)
        values = np.array([self.by_row[int(r)] for r in rows], np.float64).reshape(-1, 2)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, rows=rows, chosen=values[:, 0], rejected=values[:, 1], fingerprint=np.array(digest))
        tmp.replace(path)  # whole or not at all: a kill mid-write leaves no half file

    @classmethod
    def load(cls, path: Path, digest: str) -> ReferenceLogps | None:
        """The stored values when `path` exists and was computed for `digest`, else None."""
        if not path.exists():
            return None
        with np.load(path) as f:
            if str(f["fingerprint"]) != digest:
                print(f"{path}: computed for other pairs or another reference; recomputing", flush=True)
                return None
            return cls({int(r): (float(c), float(j)) for r, c, j in zip(f["rows"], f["chosen"], f["rejected"])})

    @classmethod
    def load_or_compute(
        cls, path: Path, digest: str, compute: Callable[[], dict[int, tuple[float, float]]]
    ) -> ReferenceLogps:
        stored = cls.load(path, digest)
        if stored is not None:
            print(f"reference log-probs: read {len(stored.by_row)} pairs from {path}", flush=True)
            return stored
        store = cls(compute())
        path.parent.mkdir(parents=True, exist_ok=True)
        store.save(path, digest)
        return store
