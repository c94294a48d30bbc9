"""Per-token log-probabilities and entropy without materialising [B, T, V] logits.

RL, DPO and distillation need `log p(target)` (and often the entropy) over
vocabularies of 150k tokens; float32 logits for 4 x 1024 tokens are 2.5 GB,
and autodiff keeps several such arrays alive. Two paths, one contract:

- `chunked_logprobs_and_entropy` walks the vocabulary in chunks of
  `chunk_size` columns with an online log-sum-exp, and a custom VJP recomputes
  each chunk's logits in the backward pass, so peak memory is one [N, chunk]
  tile plus the [D, V] weight gradient. The price is a fourth matmul.
- `saved_logprobs_and_entropy` computes the [N, V] float32 logits once and
  keeps them for the backward pass: three matmuls, N x V x 4 bytes.

`logprobs_and_entropy` picks the second when its logits fit a byte budget
(`model.logits_budget_mb`), the first otherwise. `entropy=False` skips the
entropy (and its share of the backward) for losses that do not read it.

For logits l = h W / temperature, p = softmax(l), the cotangents are
    d logp(y) / d l_j = 1[j = y] - p_j
    d H / d l_j       = -p_j (log p_j + H)
and d h = dl W^T / temperature, d W = h^T dl / temperature.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

Layout = Literal["dv", "vd"]  # weight is [D, V] (lm_head) or [V, D] (tied embedding)


def naive_logprobs_and_entropy(hidden, weight, targets, temperature=1.0, layout: Layout = "dv"):
    """Reference: full float32 logits. hidden [B, T, D], targets [B, T] -> ([B, T], [B, T])."""
    eq = "BTD,DV->BTV" if layout == "dv" else "BTD,VD->BTV"
    logits = jnp.einsum(eq, hidden, weight, preferred_element_type=jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def logprobs_and_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 8192,
    layout: Layout = "dv",
    entropy: bool = True,
    logits_budget_bytes: int = 0,
) -> tuple[jax.Array, jax.Array | None]:
    """`saved_logprobs_and_entropy` when the [N, V] float32 logits fit `logits_budget_bytes`, else
    `chunked_logprobs_and_entropy`; the entropy is None when `entropy` is False."""
    n = hidden.shape[0] * hidden.shape[1]
    vocab = _vocab_size(weight, layout)
    if n * vocab * 4 <= logits_budget_bytes:
        logp, ent = saved_logprobs_and_entropy(hidden, weight, targets, temperature, layout, entropy)
    else:
        logp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, temperature, chunk_size, layout, entropy)
    return logp, ent if entropy else None


def chunked_logprobs_and_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 8192,
    layout: Layout = "dv",
    entropy: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Same values and gradients as `naive_logprobs_and_entropy`, in O(N * chunk) memory (the entropy is zeros
    when `entropy` is False)."""
    b, t, d = hidden.shape
    vocab = _vocab_size(weight, layout)
    chunk = min(chunk_size, vocab)
    logp, ent = _chunked(
        hidden.reshape(b * t, d),
        weight,
        targets.reshape(b * t).astype(jnp.int32),
        float(temperature),
        chunk,
        layout,
        entropy,
    )
    return logp.reshape(b, t), ent.reshape(b, t)


def saved_logprobs_and_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    layout: Layout = "dv",
    entropy: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Same values and gradients as `naive_logprobs_and_entropy`; the float32 logits are kept for the backward
    pass instead of recomputed (the entropy is zeros when `entropy` is False)."""
    b, t, d = hidden.shape
    logp, ent = _saved(
        hidden.reshape(b * t, d), weight, targets.reshape(b * t).astype(jnp.int32), float(temperature), layout, entropy
    )
    return logp.reshape(b, t), ent.reshape(b, t)


def _vocab_size(weight: jax.Array, layout: Layout) -> int:
    return weight.shape[1] if layout == "dv" else weight.shape[0]


def _num_chunks(vocab: int, chunk: int) -> int:
    return -(-vocab // chunk)


def _chunk_logits(h, weight, i, chunk, temperature, layout):
    """Logits of chunk i [N, C], its column ids, and which columns are new to this chunk.

    The last chunk is clamped to end at V (no padded copy of the weight); its
    columns already covered by the previous chunk are marked invalid.
    """
    vocab = _vocab_size(weight, layout)
    start = jnp.minimum(i * chunk, vocab - chunk)
    if layout == "dv":
        w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, axis=1)  # [D, C]
        logits = jnp.einsum("ND,DC->NC", h, w, preferred_element_type=jnp.float32)
    else:
        w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)  # [C, D]
        logits = jnp.einsum("ND,CD->NC", h, w, preferred_element_type=jnp.float32)
    cols = start + jnp.arange(chunk)
    valid = cols >= i * chunk
    return logits / temperature, cols, valid, w, start


def _forward(h, weight, targets, temperature, chunk, layout, entropy):
    n = h.shape[0]

    def body(i, carry):
        m, s, u, tgt = carry
        logits, cols, valid, _, _ = _chunk_logits(h, weight, i, chunk, temperature, layout)
        masked = jnp.where(valid[None, :], logits, -jnp.inf)
        m_new = jnp.maximum(m, masked.max(axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(masked - m_new[:, None])  # 0 where invalid
        s = s * scale + e.sum(axis=-1)
        if entropy:  # u = sum_j e_j l_j, for H = lse - u / s
            u = u * scale + (e * jnp.where(valid[None, :], logits, 0.0)).sum(axis=-1)
        hit = (cols[None, :] == targets[:, None]) & valid[None, :]
        tgt = tgt + jnp.where(hit, logits, 0.0).sum(axis=-1)
        return m_new, s, u, tgt

    init = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.float32),
    )
    vocab = _vocab_size(weight, layout)
    m, s, u, tgt = jax.lax.fori_loop(0, _num_chunks(vocab, chunk), body, init)
    lse = m + jnp.log(s)
    return tgt - lse, (lse - u / s) if entropy else u, lse


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(h, weight, targets, temperature, chunk, layout, entropy):
    logp, ent, _ = _forward(h, weight, targets, temperature, chunk, layout, entropy)
    return logp, ent


def _chunked_fwd(h, weight, targets, temperature, chunk, layout, entropy):
    logp, ent, lse = _forward(h, weight, targets, temperature, chunk, layout, entropy)
    return (logp, ent), (h, weight, targets, lse, ent)


def _tiled_backward(h, weight, chunk, temperature, layout, tile_cotangent):
    """(dh, dw) of a vocabulary-tiled head from the cotangent of each tile's logits: `tile_cotangent(logits, cols,
    valid)` -> dL/dlogits [N, C] of that tile (zero on invalid columns), recomputed tile by tile."""

    def body(i, carry):
        dh, dw = carry
        logits, cols, valid, w, start = _chunk_logits(h, weight, i, chunk, temperature, layout)
        dl = tile_cotangent(logits, cols, valid) / temperature  # through the division by the temperature
        if layout == "dv":
            dh = dh + jnp.einsum("NC,DC->ND", dl, w, preferred_element_type=jnp.float32)
            dw_c = jnp.einsum("ND,NC->DC", h, dl, preferred_element_type=jnp.float32)
            old = jax.lax.dynamic_slice_in_dim(dw, start, chunk, axis=1)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_c, start, axis=1)
        else:
            dh = dh + jnp.einsum("NC,CD->ND", dl, w, preferred_element_type=jnp.float32)
            dw_c = jnp.einsum("ND,NC->CD", h, dl, preferred_element_type=jnp.float32)
            old = jax.lax.dynamic_slice_in_dim(dw, start, chunk, axis=0)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_c, start, axis=0)
        return dh, dw

    init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(weight.shape, jnp.float32))
    dh, dw = jax.lax.fori_loop(0, _num_chunks(_vocab_size(weight, layout), chunk), body, init)
    return dh.astype(h.dtype), dw.astype(weight.dtype)


def _chunked_bwd(temperature, chunk, layout, entropy, res, cotangents):
    h, weight, targets, lse, ent = res
    g_lp, g_ent = cotangents  # [N], [N]

    def tile(logits, cols, valid):
        logp_j = logits - lse[:, None]
        p = jnp.where(valid[None, :], jnp.exp(logp_j), 0.0)
        onehot = ((cols[None, :] == targets[:, None]) & valid[None, :]).astype(jnp.float32)
        dl = g_lp[:, None] * (onehot - p)
        if entropy:
            dl = dl - g_ent[:, None] * p * (logp_j + ent[:, None])
        return dl

    dh, dw = _tiled_backward(h, weight, chunk, temperature, layout, tile)
    return dh, dw, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _saved(h, weight, targets, temperature, layout, entropy):
    (logp, ent), _ = _saved_fwd(h, weight, targets, temperature, layout, entropy)
    return logp, ent


def _saved_fwd(h, weight, targets, temperature, layout, entropy):
    eq = "ND,DV->NV" if layout == "dv" else "ND,VD->NV"
    logits = jnp.einsum(eq, h, weight, preferred_element_type=jnp.float32) / temperature  # [N, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if entropy:  # H = lse - sum_j p_j l_j
        ent = lse - (jnp.exp(logits - lse[:, None]) * logits).sum(axis=-1)
    else:
        ent = jnp.zeros_like(lse)
    return (logp, ent), (h, weight, targets, logits, lse, ent)


def _saved_bwd(temperature, layout, entropy, res, cotangents):
    h, weight, targets, logits, lse, ent = res
    g_lp, g_ent = cotangents  # [N], [N]
    logp_all = logits - lse[:, None]
    p = jnp.exp(logp_all)
    dl = -g_lp[:, None] * p
    if entropy:
        dl = dl - g_ent[:, None] * p * (logp_all + ent[:, None])
    dl = dl.at[jnp.arange(h.shape[0]), targets].add(g_lp)
    dl = dl / temperature  # [N, V]
    if layout == "dv":
        dh = jnp.einsum("NV,DV->ND", dl, weight, preferred_element_type=jnp.float32)
        dw = jnp.einsum("ND,NV->DV", h, dl, preferred_element_type=jnp.float32)
    else:
        dh = jnp.einsum("NV,VD->ND", dl, weight, preferred_element_type=jnp.float32)
        dw = jnp.einsum("ND,NV->VD", h, dl, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dw.astype(weight.dtype), None


_saved.defvjp(_saved_fwd, _saved_bwd)


# ------------------------------------------------------------------ log-sum-exp outside some ids


def excluded_logsumexp(
    hidden: jax.Array,
    weight: jax.Array,
    exclude: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 8192,
    layout: Layout = "dv",
) -> jax.Array:
    """[N] log sum_{v not in exclude[i]} exp(h_i W_v / temperature) for hidden [N, D] and `exclude` [N, k]: the
    log-mass (unnormalised) of everything but k ids, summed from those logits themselves. `1 - sum_k p` loses it
    to rounding once the k ids hold all but ~1e-7 of the mass in float32; this does not. Vocabulary-tiled like
    `chunked_logprobs_and_entropy` (a custom VJP recomputes each tile: O(N x chunk) memory); ids repeated in a row
    are excluded once."""
    chunk = min(chunk_size, _vocab_size(weight, layout))
    return _excluded(hidden, weight, exclude.astype(jnp.int32), float(temperature), chunk, layout)


def _excluded_mask(exclude, cols, valid):
    """[N, C] True where a column of this tile is kept (valid, and not one of the row's excluded ids)."""
    n, c = exclude.shape[0], cols.shape[0]
    start = cols[0]
    local = jnp.where((exclude >= start) & (exclude < start + c), exclude - start, c)  # out of this tile: dropped
    hit = jnp.zeros((n, c), bool).at[jnp.arange(n)[:, None], local].set(True, mode="drop")
    return valid[None, :] & ~hit


def _excluded_forward(h, weight, exclude, temperature, chunk, layout):
    n = h.shape[0]

    def body(i, carry):
        m, s = carry
        logits, cols, valid, _, _ = _chunk_logits(h, weight, i, chunk, temperature, layout)
        masked = jnp.where(_excluded_mask(exclude, cols, valid), logits, -jnp.inf)
        m_new = jnp.maximum(m, masked.max(axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a tile with nothing kept yet
        s = s * jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf)) + jnp.exp(masked - safe[:, None]).sum(-1)
        return m_new, s

    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    m, s = jax.lax.fori_loop(0, _num_chunks(_vocab_size(weight, layout), chunk), body, init)
    return m + jnp.log(s)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _excluded(h, weight, exclude, temperature, chunk, layout):
    return _excluded_forward(h, weight, exclude, temperature, chunk, layout)


def _excluded_fwd(h, weight, exclude, temperature, chunk, layout):
    lse = _excluded_forward(h, weight, exclude, temperature, chunk, layout)
    return lse, (h, weight, exclude, lse)


def _excluded_bwd(temperature, chunk, layout, res, g):
    """d lse / d l_j = softmax over the kept columns (0 on the excluded ones)."""
    h, weight, exclude, lse = res

    def tile(logits, cols, valid):
        return g[:, None] * jnp.where(_excluded_mask(exclude, cols, valid), jnp.exp(logits - lse[:, None]), 0.0)

    dh, dw = _tiled_backward(h, weight, chunk, temperature, layout, tile)
    return dh, dw, None


_excluded.defvjp(_excluded_fwd, _excluded_bwd)
