"""Running the position-wise layers on a batch's real tokens only (`PackedBatch.compact`).

Rows of a packed batch hold padding (a padded row's tail, the holes first-fit
packing leaves, a DPO pair shorter than the longest in its batch): 10-45% of
the positions in the SFT and DPO benchmarks. Everything in a decoder layer but
attention works position by position (projections, MLP, norms, RoPE), so it
can run on a flat list of the real tokens instead of the rows, and only
attention needs the row layout, to which q, k and v are gathered and from
which its output is gathered back (a few MB a layer, against the MLP's
matmuls on every padding position saved).

    layout = Compaction.of(segment_ids, compact)   # or None when it saves nothing
    x = layout.to_compact(rows_array)              # [R, L, ...] -> [S, N, ...]
    y = layout.to_rows(x)                          # [S, N, ...] -> [R, L, ...], padding positions 0

`S` is the number of parts the batch axis of the rows is split into over the
current mesh (`core.mesh.row_shards`): each part compacts its own rows, so a
data-parallel batch stays on its devices. `N` (`compact`) is at least the real
tokens of the fullest part, so no real token is dropped (set by
`core.batch.with_compact` from the same batch); entries past a part's real
tokens hold a copy of its first position, are never read back, and so get no
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from core.mesh import row_shards


@dataclass(frozen=True)
class Compaction:
    take: jax.Array  # [S, N] int32: the position (within its part's R/S * L) of compact token n
    put: jax.Array  # [S, P] int32: the compact token at position p, N (a zero row) for padding
    rows: int  # R
    length: int  # L
    count: jax.Array  # [S] int32: the real tokens of each part (compact tokens 0..count-1 are real)

    @staticmethod
    def of(segment_ids: jax.Array, compact: int) -> Compaction | None:
        """The layout of `segment_ids` [R, L] (0 = padding) compacted to `compact` tokens a part; None when
        `compact` is 0 or does not leave fewer positions than the rows."""
        rows, length = segment_ids.shape
        shards = row_shards(rows)
        slots = rows // shards * length
        if not 0 < compact < slots:
            return None
        real = segment_ids.reshape(shards, slots) > 0
        take = jax.vmap(lambda m: jnp.nonzero(m, size=compact, fill_value=0)[0])(real).astype(jnp.int32)
        put = jnp.where(real, jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, compact)
        return Compaction(take, put, rows, length, real.sum(axis=1, dtype=jnp.int32))

    def to_compact(self, x: jax.Array) -> jax.Array:
        """[R, L, ...] -> [S, N, ...]: the real positions of each part, in row order."""
        shards = self.take.shape[0]
        parts = x.reshape(shards, -1, *x.shape[2:])
        return jax.vmap(lambda part, idx: part[idx])(parts, self.take)

    def real(self) -> jax.Array:
        """[S, N] bool: which compact tokens are real (the rest copy a part's first position)."""
        return jnp.arange(self.take.shape[1], dtype=jnp.int32)[None, :] < self.count[:, None]

    def to_rows(self, x: jax.Array) -> jax.Array:
        """[S, N, ...] -> [R, L, ...]: each compact token back at its position, zeros on padding."""
        padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)  # index N reads the zero row
        out = jax.vmap(lambda part, idx: part[idx])(padded, self.put)
        return out.reshape(self.rows, self.length, *x.shape[2:])
