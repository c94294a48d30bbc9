"""Every attention implementation equals the reference; the reference equals a NumPy loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.kernels.attention import attention, make_mask


def numpy_attention(q, k, v, q_seg, kv_seg, window=None):
    """Independent reference: explicit loops over batch, head and query, float64."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for bi in range(b):
        for hi in range(n):
            kh = hi // g
            for ti in range(t):
                allowed = [
                    s
                    for s in range(t)
                    if s <= ti and q_seg[bi, ti] == kv_seg[bi, s] and (window is None or s > ti - window)
                ]
                scores = np.array([q[bi, ti, hi] @ k[bi, s, kh] for s in allowed]) / np.sqrt(h)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[bi, ti, hi] = sum(pi * v[bi, s, kh] for pi, s in zip(p, allowed))
    return out


def inputs(seed=0, b=2, t=12, n=4, kv=2, h=8):
    rng = np.random.RandomState(seed)
    q, k, v = (rng.randn(b, t, x, h).astype(np.float32) for x in (n, kv, kv))
    # row 0: two packed documents; row 1: 9 real tokens then right padding (segment 0)
    seg = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3], np.int32)
    return q, k, v, seg


@pytest.mark.parametrize("window", [None, 3])
def test_reference_matches_numpy(window):
    q, k, v, seg = inputs()
    idx = np.broadcast_to(np.arange(12), (2, 12))
    mask = make_mask(jnp.asarray(idx), jnp.asarray(idx), jnp.asarray(seg), jnp.asarray(seg), window)
    out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, "xla")
    ref = numpy_attention(q, k, v, seg, seg, window)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dot_product_equals_reference(dtype):
    q, k, v, seg = inputs(1)
    idx = jnp.broadcast_to(jnp.arange(12), (2, 12))
    mask = make_mask(idx, idx, jnp.asarray(seg), jnp.asarray(seg))
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    ref = attention(*args, mask, "xla")
    out = attention(*args, mask, "dot_product")
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol)


def test_gradients_agree():
    q, k, v, seg = inputs(2)
    idx = jnp.broadcast_to(jnp.arange(12), (2, 12))
    mask = make_mask(idx, idx, jnp.asarray(seg), jnp.asarray(seg))

    def f(impl):
        return jax.grad(lambda q, k, v: attention(q, k, v, mask, impl).sum(), argnums=(0, 1, 2))

    for a, b in zip(f("xla")(q, k, v), f("dot_product")(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("t", [256, 264, 200])
def test_causal_blocks_equal_the_reference(t):
    """Query blocks over the keys up to their own (4 blocks at 256 and 264 tokens; 200 splits into blocks of 50,
    under the minimum, and falls back): values and gradients equal the reference's on a mask with packed
    documents, padding and branches."""
    from core.kernels.attention import causal_blocks, reference

    rng = np.random.RandomState(4)
    q, k, v = (jnp.asarray(rng.randn(2, t, x, 16), jnp.float32) for x in (4, 2, 2))
    idx = jnp.broadcast_to(jnp.arange(t), (2, t))
    seg = np.ones((2, t), np.int32)
    seg[0, t // 3 :] = 2  # two documents
    seg[1, t - 5 :] = 0  # padding
    branch = np.zeros((2, t), np.int32)
    branch[1, t // 2 : t - 20], branch[1, t - 20 : t - 5] = 1, 2  # a prefix and two branches
    mask = make_mask(
        idx, idx, jnp.asarray(seg), jnp.asarray(seg), q_branch=jnp.asarray(branch), kv_branch=jnp.asarray(branch)
    )
    cot = jnp.asarray(rng.randn(2, t, 4, 16), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)  # one compilation instead of eager op-by-op dispatch
    def run(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
        return [out, *vjp(cot)]

    for a, b in zip(run(causal_blocks), run(reference), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_less(np.abs(a - b), 16 * np.spacing(np.abs(b).max()))
    # the dispatch: causal=True runs causal_blocks (both eager here, so the same ops in the same order)
    assert np.array_equal(
        np.asarray(attention(q, k, v, mask, "xla", causal=True)), np.asarray(causal_blocks(q, k, v, mask))
    )


def test_unknown_impl():
    q, k, v, _seg = inputs()
    idx = jnp.broadcast_to(jnp.arange(12), (2, 12))
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention(q, k, v, make_mask(idx, idx), "flash")


@pytest.mark.gpu_only
def test_cudnn_equals_reference():
    q, k, v, _seg = inputs(3, t=16, h=64)
    idx = jnp.broadcast_to(jnp.arange(16), (2, 16))
    mask = make_mask(idx, idx)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    ref = attention(*args, mask, "xla")
    out = attention(*args, mask, "cudnn")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@pytest.mark.parametrize("window", [None, 5])
def test_a_decode_step_against_a_cache_it_only_reads_equals_the_reference(window):
    """`cached_step`: one query a row against the cache's keys before its position and its own key equals the
    reference attention over the cache with the new key written at the position (rows at different positions,
    stale keys after them that must not count, GQA, a sliding window)."""
    from core.kernels.attention import cached_step, reference, window_mask

    b, s, n, kv, h = 3, 12, 4, 2, 8
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(b, 1, n, h), jnp.float32)
    cache_k, cache_v = (jnp.asarray(rng.randn(b, s, kv, h), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.randn(b, 1, kv, h), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[0], [4], [11]], jnp.int32)
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    written_k = cache_k.at[jnp.arange(b)[:, None], positions].set(k)
    written_v = cache_v.at[jnp.arange(b)[:, None], positions].set(v)
    mask = make_mask(positions, slots, sliding_window=window)
    before = slots[:, None, :] < positions[:, :, None]
    if window is not None:
        before &= window_mask(positions, slots, window)
    want = reference(q, written_k, written_v, mask)
    np.testing.assert_allclose(cached_step(q, cache_k, cache_v, before, k, v), want, rtol=1e-5, atol=1e-6)
