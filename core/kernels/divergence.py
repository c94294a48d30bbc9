"""The divergence between two models' next-token distributions, without [N, V] logits of either.

    kd = chunked_divergence(h_s, w_s, h_t, w_t, "forward", temperature=2.0, chunk_size=8192)   # [N]
    kd = naive_divergence(h_s, w_s, h_t, w_t, "forward", temperature=2.0)                      # the reference
    kd = divergence_of_logprobs(logq, logp, "jsd", beta=0.5)                  # [..., V] log-probs -> [...]
    ids, logp = chunked_topk(h_t, w_t, k=128, chunk_size=8192)     # a model's top-k ids and log-probs, [N, k] each

With q the student's and p the teacher's distribution at temperature T (softmax(h W / T)), per token:

    forward   KL(p || q) = sum_v p_v (log p_v - log q_v)
    reverse   KL(q || p) = sum_v q_v (log q_v - log p_v)
    jsd       beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q (TRL's generalised JSD: beta = 0
              is forward KL, beta = 1 reverse KL)

Each is a sum over the vocabulary of a term that depends on token v's two log-probs alone, log q_v = z_v - lse_q
and log p_v = a_v - lse_p. So the vocabulary can be walked in chunks, as the log-prob head does
(`core.kernels.logprobs`): a first pass finds both log-sum-exps (online), a second sums the terms. Only the student
is differentiated: d/dz_v of the total is the term's own derivative plus (sum_u d term_u / d lse_q) q_v, and that sum
is taken in the forward pass when it runs under differentiation (in closed form for the two KLs, which also need
only one forward pass: their sums can be kept online beside the log-sum-exps); the backward pass recomputes each
chunk's logits once more and forms d h_s and d W_s. Peak memory is a few [N, chunk] tiles and the student's weight
gradient, never a [N, V] array; the cost is the logits recomputed (`bench/kd_memory.py` measures both).

A teacher with a larger vocabulary than the student's over the same tokenizer (Qwen2.5's 7B and larger embed
152,064 rows, the smaller ones 151,936: padding rows no token maps to) is read over the student's vocabulary only:
its extra rows are ignored. Posttrain's distillation losses (`posttrain.losses.distill`) use these divergences.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

from core.kernels.logprobs import Layout

Divergence = Literal["forward", "reverse", "jsd"]


def _kl(log_a: jax.Array, log_b: jax.Array) -> jax.Array:
    """KL(a || b) over the last axis from log-probabilities; 0 log 0 = 0 (and a finite gradient there)."""
    a = jnp.exp(log_a)
    return jnp.sum(a * jnp.where(a > 0, log_a - log_b, 0.0), axis=-1)


def divergence_of_logprobs(logq: jax.Array, logp: jax.Array, kind: Divergence, beta: float = 0.5) -> jax.Array:
    """[..., V] student (q) and teacher (p) log-probabilities -> [...] divergence (module docstring). Entries of
    -inf on both sides (columns outside the vocabulary) add nothing."""
    logq, logp = logq.astype(jnp.float32), logp.astype(jnp.float32)
    if kind == "forward" or (kind == "jsd" and beta == 0.0):
        return _kl(logp, logq)
    if kind == "reverse" or (kind == "jsd" and beta == 1.0):
        return _kl(logq, logp)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 <= beta <= 1, got {beta}")
        logm = jnp.logaddexp(logq + math.log(1.0 - beta), logp + math.log(beta))
        return beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)
    raise ValueError(f"unknown divergence {kind!r}")


def _vocab(weight: jax.Array, layout: Layout) -> int:
    return weight.shape[1] if layout == "dv" else weight.shape[0]


def _logits(h: jax.Array, weight: jax.Array, start, size: int, temperature: float, layout: Layout):
    """h [N, D] x the weight's columns [start, start + size) -> [N, size] float32 logits / T, and that slice."""
    if layout == "dv":
        w = jax.lax.dynamic_slice_in_dim(weight, start, size, axis=1)
        return jnp.einsum("ND,DC->NC", h, w, preferred_element_type=jnp.float32) / temperature, w
    w = jax.lax.dynamic_slice_in_dim(weight, start, size, axis=0)
    return jnp.einsum("ND,CD->NC", h, w, preferred_element_type=jnp.float32) / temperature, w


def naive_divergence(h_s, w_s, h_t, w_t, kind: Divergence, temperature=1.0, beta=0.5, layout_s="dv", layout_t="dv"):
    """Reference: both models' [N, V] float32 logits (the teacher's over the student's vocabulary)."""
    vocab = _vocab(w_s, layout_s)
    zs, _ = _logits(h_s, w_s, 0, vocab, temperature, layout_s)
    zt, _ = _logits(h_t, w_t, 0, vocab, temperature, layout_t)
    return divergence_of_logprobs(jax.nn.log_softmax(zs, -1), jax.nn.log_softmax(zt, -1), kind, beta)


def chunked_divergence(
    h_s: jax.Array,
    w_s: jax.Array,
    h_t: jax.Array,
    w_t: jax.Array,
    kind: Divergence,
    temperature: float = 1.0,
    beta: float = 0.5,
    chunk_size: int = 8192,
    layout_s: Layout = "dv",
    layout_t: Layout = "dv",
) -> jax.Array:
    """[N] divergence of the student (hidden states `h_s` [N, Ds], output weight `w_s`) from the teacher (`h_t`
    [N, Dt], `w_t`), equal to `naive_divergence` in value and in its gradient with respect to `h_s` and `w_s`; the
    teacher gets none. Weights are [D, V] (`dv`, an lm_head) or [V, D] (`vd`, a tied embedding)."""
    vocab = _vocab(w_s, layout_s)
    if _vocab(w_t, layout_t) < vocab:
        raise ValueError(
            f"the teacher's output has {_vocab(w_t, layout_t)} rows, fewer than the student's vocabulary ({vocab}): "
            f"they do not share a tokenizer"
        )
    spec = _Spec(kind, float(temperature), float(beta), min(chunk_size, vocab), layout_s, layout_t)
    return _chunked(spec, h_s, w_s, jax.lax.stop_gradient(h_t), jax.lax.stop_gradient(w_t))


class _Spec(tuple):
    """The static settings of one chunked divergence (hashable, for custom_vjp's nondiff argument)."""

    def __new__(cls, kind, temperature, beta, chunk, layout_s, layout_t):
        return super().__new__(cls, (kind, temperature, beta, chunk, layout_s, layout_t))

    kind = property(lambda self: self[0])
    temperature = property(lambda self: self[1])
    beta = property(lambda self: self[2])
    chunk = property(lambda self: self[3])
    layout_s = property(lambda self: self[4])
    layout_t = property(lambda self: self[5])


def _chunk_pair(spec: _Spec, h_s, w_s, h_t, w_t, i):
    """Chunk i's student and teacher logits / T [N, C], the student's weight slice, where it starts, which of its
    columns are new (the last chunk is clamped to end at V, overlapping the one before)."""
    vocab = _vocab(w_s, spec.layout_s)
    start = jnp.minimum(i * spec.chunk, vocab - spec.chunk)
    zs, w = _logits(h_s, w_s, start, spec.chunk, spec.temperature, spec.layout_s)
    zt, _ = _logits(h_t, w_t, start, spec.chunk, spec.temperature, spec.layout_t)
    valid = (start + jnp.arange(spec.chunk)) >= i * spec.chunk
    return zs, zt, w, start, valid


def _terms(spec: _Spec, zs, zt, lse_s, lse_t, valid):
    """[N] the divergence's terms over one chunk's columns, given both per-token log-sum-exps."""
    logq = jnp.where(valid[None, :], zs - lse_s[:, None], -jnp.inf)
    logp = jnp.where(valid[None, :], zt - lse_t[:, None], -jnp.inf)
    return divergence_of_logprobs(logq, logp, spec.kind, spec.beta)


def _num_chunks(spec: _Spec, w_s) -> int:
    return -(-_vocab(w_s, spec.layout_s) // spec.chunk)


def _log_sum_exps(spec: _Spec, h_s, w_s, h_t, w_t):
    n = h_s.shape[0]

    def online(m, s, z, valid):
        masked = jnp.where(valid[None, :], z, -jnp.inf)
        m_new = jnp.maximum(m, masked.max(axis=-1))
        return m_new, s * jnp.exp(m - m_new) + jnp.exp(masked - m_new[:, None]).sum(axis=-1)

    def body(i, carry):
        ms, ss, mt, st = carry
        zs, zt, _, _, valid = _chunk_pair(spec, h_s, w_s, h_t, w_t, i)
        return (*online(ms, ss, zs, valid), *online(mt, st, zt, valid))

    start = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.full((n,), -jnp.inf), jnp.zeros((n,)))
    ms, ss, mt, st = jax.lax.fori_loop(0, _num_chunks(spec, w_s), body, start)
    return ms + jnp.log(ss), mt + jnp.log(st)


def _kl_one_pass(spec: _Spec, h_s, w_s, h_t, w_t, reverse: bool):
    """Forward or reverse KL in one pass over the vocabulary: with a = teacher and b = student logits / T,
    KL(p || q) = sum_v e^(a_v - lse_a) (a_v - b_v) - lse_a + lse_b, the sum kept online (rescaled as the maximum
    moves) beside both log-sum-exps; reverse KL the same with the roles swapped. Returns (kl, lse_s, lse_t)."""
    n = h_s.shape[0]

    def body(i, carry):
        ms, ss, mt, st, acc = carry
        zs, zt, _, _, valid = _chunk_pair(spec, h_s, w_s, h_t, w_t, i)
        zs_m = jnp.where(valid[None, :], zs, -jnp.inf)
        zt_m = jnp.where(valid[None, :], zt, -jnp.inf)
        ms_new, mt_new = jnp.maximum(ms, zs_m.max(-1)), jnp.maximum(mt, zt_m.max(-1))
        es, et = jnp.exp(zs_m - ms_new[:, None]), jnp.exp(zt_m - mt_new[:, None])  # 0 on repeated columns
        diff = jnp.where(valid[None, :], zs - zt, 0.0)  # b - a
        if reverse:  # weights of the student, rescaled with its maximum
            acc = acc * jnp.exp(ms - ms_new) + (es * diff).sum(-1)
        else:
            acc = acc * jnp.exp(mt - mt_new) - (et * diff).sum(-1)
        ss = ss * jnp.exp(ms - ms_new) + es.sum(-1)
        st = st * jnp.exp(mt - mt_new) + et.sum(-1)
        return ms_new, ss, mt_new, st, acc

    start = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)))
    ms, ss, mt, st, acc = jax.lax.fori_loop(0, _num_chunks(spec, w_s), body, start)
    lse_s, lse_t = ms + jnp.log(ss), mt + jnp.log(st)
    if reverse:
        return acc / ss - lse_s + lse_t, lse_s, lse_t
    return acc / st - lse_t + lse_s, lse_s, lse_t


def _forward(spec: _Spec, h_s, w_s, h_t, w_t, with_lse_grad: bool):
    """([N] divergence, [N] d divergence / d lse_s of the terms as `_terms` writes them (with `with_lse_grad`),
    both log-sum-exps)."""
    n = h_s.shape[0]
    kl_kind = _kl_kind(spec)
    if kl_kind is not None:  # one pass, and d/d lse_s in closed form: sum_v p_v = 1, or -(KL + 1)
        kl, lse_s, lse_t = _kl_one_pass(spec, h_s, w_s, h_t, w_t, reverse=kl_kind == "reverse")
        return kl, jnp.ones_like(kl) if kl_kind == "forward" else -(kl + 1.0), lse_s, lse_t
    lse_s, lse_t = _log_sum_exps(spec, h_s, w_s, h_t, w_t)

    def body(i, carry):
        total, g_lse = carry
        zs, zt, _, _, valid = _chunk_pair(spec, h_s, w_s, h_t, w_t, i)
        if not with_lse_grad:
            return total + _terms(spec, zs, zt, lse_s, lse_t, valid), g_lse
        value, pull = jax.vjp(lambda lse: _terms(spec, zs, zt, lse, lse_t, valid), lse_s)
        return total + value, g_lse + pull(jnp.ones_like(value))[0]

    zeros = (jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    total, g_lse = jax.lax.fori_loop(0, _num_chunks(spec, w_s), body, zeros)
    return total, g_lse, lse_s, lse_t


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(spec: _Spec, h_s, w_s, h_t, w_t):
    return _forward(spec, h_s, w_s, h_t, w_t, with_lse_grad=False)[0]


def _chunked_fwd(spec: _Spec, h_s, w_s, h_t, w_t):
    total, g_lse, lse_s, lse_t = _forward(spec, h_s, w_s, h_t, w_t, with_lse_grad=True)
    return total, (h_s, w_s, h_t, w_t, g_lse, lse_s, lse_t, total)


def _kl_kind(spec: _Spec) -> str | None:
    if spec.kind == "forward" or (spec.kind == "jsd" and spec.beta == 0.0):
        return "forward"
    if spec.kind == "reverse" or (spec.kind == "jsd" and spec.beta == 1.0):
        return "reverse"
    return None


def _chunked_bwd(spec: _Spec, res, g):
    h_s, w_s, h_t, w_t, g_lse, lse_s, lse_t, total = res
    kl = _kl_kind(spec)

    def body(i, carry):
        dh, dw = carry
        zs, zt, w, start, valid = _chunk_pair(spec, h_s, w_s, h_t, w_t, i)
        logq = zs - lse_s[:, None]
        q = jnp.where(valid[None, :], jnp.exp(logq), 0.0)  # d lse_s / d z
        if kl == "forward":  # d KL(p || q) / d z = q - p
            dz = g[:, None] * (q - jnp.where(valid[None, :], jnp.exp(zt - lse_t[:, None]), 0.0))
        elif kl == "reverse":  # d KL(q || p) / d z_v = q_v (log q_v - log p_v - KL)
            dz = g[:, None] * q * (logq - (zt - lse_t[:, None]) - total[:, None])
        else:  # the terms' own derivative, and through lse_s
            _, pull = jax.vjp(lambda z: _terms(spec, z, zt, lse_s, lse_t, valid), zs)
            dz = pull(g)[0] + (g * g_lse)[:, None] * q
        dz = dz / spec.temperature  # [N, C], zero on repeated columns
        if spec.layout_s == "dv":
            dh = dh + jnp.einsum("NC,DC->ND", dz, w, preferred_element_type=jnp.float32)
            dw_c = jnp.einsum("ND,NC->DC", h_s, dz, preferred_element_type=jnp.float32)
            old = jax.lax.dynamic_slice_in_dim(dw, start, spec.chunk, axis=1)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_c, start, axis=1)
        else:
            dh = dh + jnp.einsum("NC,CD->ND", dz, w, preferred_element_type=jnp.float32)
            dw_c = jnp.einsum("ND,NC->CD", h_s, dz, preferred_element_type=jnp.float32)
            old = jax.lax.dynamic_slice_in_dim(dw, start, spec.chunk, axis=0)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_c, start, axis=0)
        return dh, dw

    zeros = (jnp.zeros(h_s.shape, jnp.float32), jnp.zeros(w_s.shape, jnp.float32))
    dh, dw = jax.lax.fori_loop(0, _num_chunks(spec, w_s), body, zeros)
    return dh.astype(h_s.dtype), dw.astype(w_s.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_topk(
    h: jax.Array, weight: jax.Array, k: int, chunk_size: int = 8192, layout: Layout = "dv", vocab: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """A model's k most likely next tokens and their log-probs over the whole vocabulary ([N, k] int32, [N, k]
    float32, most likely first), from hidden states [N, D] (already divided by a temperature, if any) and the
    output weight, walking the vocabulary in chunks: the running top-k merged with each chunk's, the log-sum-exp
    kept online. Never differentiated (a teacher's). `vocab`: read only the first `vocab` rows (a teacher's
    padded embedding over the student's vocabulary)."""
    vocab = min(_vocab(weight, layout), vocab or _vocab(weight, layout))
    chunk = min(chunk_size, vocab)
    if k > vocab:
        raise ValueError(f"top-{k} of a vocabulary of {vocab}")
    h = jax.lax.stop_gradient(h)
    n = h.shape[0]

    def body(i, carry):
        m, s, top_z, top_ids = carry
        start = jnp.minimum(i * chunk, vocab - chunk)
        z, _ = _logits(h, weight, start, chunk, 1.0, layout)
        ids = start + jnp.arange(chunk, dtype=jnp.int32)
        z = jnp.where((ids >= i * chunk)[None, :], z, -jnp.inf)  # columns the clamped last chunk repeats
        m_new = jnp.maximum(m, z.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None]).sum(-1)
        both_z = jnp.concatenate([top_z, z], axis=-1)
        both_ids = jnp.concatenate([top_ids, jnp.broadcast_to(ids, (n, chunk))], axis=-1)
        top_z, where = jax.lax.top_k(both_z, k)
        return m_new, s, top_z, jnp.take_along_axis(both_ids, where, axis=-1)

    start = (
        jnp.full((n,), -jnp.inf),
        jnp.zeros((n,)),
        jnp.full((n, k), -jnp.inf),
        jnp.zeros((n, k), jnp.int32),
    )
    m, s, top_z, top_ids = jax.lax.fori_loop(0, -(-vocab // chunk), body, start)
    return top_ids, top_z - (m + jnp.log(s))[:, None]
