"""Multi-head attention behind one function, with selectable implementations.

All implementations take the same inputs and the same boolean mask and must
agree with `reference` (tested):

- `xla`: plain einsum + masked softmax, the readable reference; for
  self-attention over a row (`causal=True`: the mask never lets query t see a
  key after t, as in training) it runs in query blocks that skip the keys
  above the diagonal (`causal_blocks`).
- `dot_product`: `jax.nn.dot_product_attention` with XLA (any backend).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only.

Shapes: q [B, T, N, H]; k, v [B, S, K, H] with N a multiple of K (GQA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.config import AttentionImpl as Impl

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free


def make_mask(
    q_index: jax.Array,
    kv_index: jax.Array,
    q_segment: jax.Array | None = None,
    kv_segment: jax.Array | None = None,
    sliding_window: int | None = None,
    *,
    q_branch: jax.Array | None = None,
    kv_branch: jax.Array | None = None,
) -> jax.Array:
    """Boolean [B, T, S]: query t may attend key s.

    Causal on token *indices* (order within the row), restricted to the same
    segment (packed documents do not see each other; padding is segment 0 and
    only sees padding), and optionally to the last `sliding_window` keys.

    Branches share a prefix (GRPO: one prompt, several completions in one
    segment): branch 0 is the prefix, seen by every token of its segment;
    a token of branch k >= 1 also sees the earlier tokens of branch k only.
    """
    mask = kv_index[:, None, :] <= q_index[:, :, None]  # [B, T, S]
    if q_segment is not None and kv_segment is not None:
        mask &= q_segment[:, :, None] == kv_segment[:, None, :]
    if q_branch is not None and kv_branch is not None:
        mask &= (kv_branch[:, None, :] == 0) | (kv_branch[:, None, :] == q_branch[:, :, None])
    if sliding_window is not None:
        mask &= window_mask(q_index, kv_index, sliding_window)
    return mask


def window_mask(q_position: jax.Array, kv_position: jax.Array, sliding_window: int) -> jax.Array:
    """Boolean [B, T, S]: key s is among the last `sliding_window` positions up to query t's."""
    return kv_position[:, None, :] > q_position[:, :, None] - sliding_window


def reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Einsum attention with a float32 softmax. Returns [B, T, N, H] in q's dtype."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h)  # [B, T, K, G, H]
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h)


def cached_step(
    q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, mask: jax.Array, k: jax.Array, v: jax.Array
) -> jax.Array:
    """One query a row (a decode step) against a KV cache it does not write: the keys the cache holds where `mask`
    allows (before the query's position), and the query's own key `k` / value `v`. q [B, 1, N, H]; cache_k/v
    [B, S, K, H]; mask [B, 1, S]; k, v [B, 1, K, H]. Returns [B, 1, N, H] in q's dtype.

    The same softmax as `reference` over the cache with the new key written in; written as products and sums
    over the keys, which XLA:CPU runs several times faster than batched matrix-vector products, and reading the
    cache only: a step writes its new keys into the cache once, after every layer (`Decoder.with_cache`), not a
    new copy of each layer's cache."""
    b, _, n, h = q.shape
    kv = cache_k.shape[2]
    qg = q.reshape(b, 1, kv, n // kv, h).astype(jnp.float32)  # [B, 1, K, G, H]
    scale = h**-0.5
    scores = (qg * cache_k[:, :, :, None, :].astype(jnp.float32)).sum(-1) * scale  # [B, S, K, G]
    scores = jnp.where(mask[:, 0][:, :, None, None], scores, _MASKED)
    own = (qg * k[:, :, :, None, :].astype(jnp.float32)).sum(-1) * scale  # [B, 1, K, G]
    top = jnp.maximum(scores.max(axis=1, keepdims=True), own)
    weights, weight_own = jnp.exp(scores - top), jnp.exp(own - top)
    total = weights.sum(axis=1, keepdims=True) + weight_own  # [B, 1, K, G]
    out = (weights[..., None] * cache_v[:, :, :, None, :].astype(jnp.float32)).sum(1, keepdims=True)
    out = (out + weight_own[..., None] * v[:, :, :, None, :].astype(jnp.float32)) / total[..., None]
    return out.reshape(b, 1, n, h).astype(q.dtype)


def causal_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, blocks: int = 4) -> jax.Array:
    """`reference` for self-attention whose mask is causal in row order (q, k and v over the same T tokens; key
    s > t never attends query t): query block i attends the keys of blocks 0..i only.

    The skipped blocks above the diagonal are 37.5% of the scores at 4 blocks, and each block's scores are
    a quarter of the row's, small enough to stay in cache through the softmax and its backward pass: on the
    2-core CPU, forward + backward at 8 rows x 256 tokens, 8/4 heads of 64 take half the time of `reference`.
    Falls back to `reference` when T does not split into blocks of at least 64 tokens: shorter rows gain
    little, and the extra ops cost compile time."""
    t = q.shape[1]
    if t % blocks or t // blocks < 64:
        return reference(q, k, v, mask)
    size = t // blocks
    outs = []
    for i in range(blocks):
        lo, hi = i * size, (i + 1) * size
        outs.append(reference(q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi]))
    return jnp.concatenate(outs, axis=1)


def _dot_product(q, k, v, mask, implementation):
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, :, :], implementation=implementation)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: Impl = "xla", causal: bool = False
) -> jax.Array:
    """Dispatch to the selected implementation; see the module docstring. `causal` promises that the mask is
    causal in row order over the same T tokens for queries and keys (self-attention in training, not a KV
    cache)."""
    if impl == "xla":
        return causal_blocks(q, k, v, mask) if causal else reference(q, k, v, mask)
    if impl == "dot_product":
        return _dot_product(q, k, v, mask, "xla")
    if impl == "cudnn":
        return _dot_product(q, k, v, mask, "cudnn")
    raise ValueError(f"unknown attention implementation {impl!r}; choose xla, dot_product or cudnn")
