"""The log-prob head's two paths (vocabulary-tiled and recomputed; logits kept for the backward) equal the naive
computation, values and gradients, with and without the entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.kernels.logprobs import (
    chunked_logprobs_and_entropy,
    logprobs_and_entropy,
    naive_logprobs_and_entropy,
    saved_logprobs_and_entropy,
)


def numpy_reference(h, w, y, temperature):
    logits = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
    logits -= logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, y[..., None], -1)[..., 0]
    return logp, -(np.exp(logp_all) * logp_all).sum(-1)


def data(seed=0, b=2, t=7, d=16, v=300):
    rng = np.random.RandomState(seed)
    # weights scaled like an initialised output layer, so logits are O(1) as in a real model
    return (
        rng.randn(b, t, d).astype(np.float32),
        (rng.randn(d, v) / np.sqrt(d)).astype(np.float32),
        rng.randint(0, v, (b, t)).astype(np.int32),
    )


# chunk None: the saved-logits path; 100 does not divide 300; 1024 > V
@pytest.mark.parametrize("chunk", [64, 100, 300, 1024, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_numpy(chunk, temperature):
    h, w, y = data()
    if chunk is None:
        logp, ent = saved_logprobs_and_entropy(h, w, y, temperature)
    else:
        logp, ent = chunked_logprobs_and_entropy(h, w, y, temperature, chunk)
    ref_lp, ref_ent = numpy_reference(h, w, y, temperature)
    np.testing.assert_allclose(np.asarray(logp), ref_lp, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=1e-5)


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("chunk", [64, 100, 300, None])  # 300 = V: a single tile; None: logits saved
def test_gradients_match_naive(layout, chunk, entropy):
    h, w, y = data(1)
    if layout == "vd":
        w = np.ascontiguousarray(w.T)
    g_lp, g_ent = np.random.RandomState(2).randn(2, *y.shape).astype(np.float32)
    g_ent = g_ent if entropy else 0 * g_ent  # without the entropy, only log p(target) is differentiated

    def objective(fn):
        def f(h, w):
            logp, ent = fn(h, w)
            return (logp * g_lp).sum() + (ent * g_ent).sum()

        return jax.value_and_grad(f, argnums=(0, 1))

    naive = objective(lambda h, w: naive_logprobs_and_entropy(h, w, y, 0.8, layout))
    if chunk is None:
        chunked = objective(lambda h, w: saved_logprobs_and_entropy(h, w, y, 0.8, layout, entropy))
    else:
        chunked = objective(lambda h, w: chunked_logprobs_and_entropy(h, w, y, 0.8, chunk, layout, entropy))
    (v_n, (dh_n, dw_n)), (v_c, (dh_c, dw_c)) = naive(h, w), chunked(h, w)
    assert abs(float(v_n) - float(v_c)) <= 1e-4
    np.testing.assert_allclose(np.asarray(dh_c), np.asarray(dh_n), atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw_c), np.asarray(dw_n), atol=1e-5)


def test_jit_and_bfloat16_hidden():
    h, w, y = data(3)
    f = jax.jit(lambda h, w: chunked_logprobs_and_entropy(h, w, y, 1.0, 128))
    logp, _ = f(jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    ref, _ = naive_logprobs_and_entropy(jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), y)
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), atol=1e-3)
    dh = jax.grad(lambda h: f(h, jnp.asarray(w, jnp.bfloat16))[0].sum())(jnp.asarray(h, jnp.bfloat16))
    assert dh.dtype == jnp.bfloat16


def test_without_entropy_the_entropy_is_not_computed():
    h, w, y = data(4)
    for fn in (
        lambda: chunked_logprobs_and_entropy(h, w, y, 1.0, 64, entropy=False),
        lambda: saved_logprobs_and_entropy(h, w, y, 1.0, entropy=False),
    ):
        logp, ent = fn()
        np.testing.assert_allclose(np.asarray(logp), numpy_reference(h, w, y, 1.0)[0], atol=1e-5)
        assert not np.asarray(ent).any()  # zeros, not an entropy
    assert logprobs_and_entropy(h, w, y, entropy=False)[1] is None


def test_the_budget_picks_the_path_by_the_size_of_the_logits():
    """Under the budget the backward pass holds the [N, V] logits; over it, [N, chunk] tiles (XLA's own count)."""
    rng = np.random.RandomState(5)
    n, d, v = 2048, 16, 512  # logits 4 MiB; tiles of 64 columns 0.5 MiB; the weight 32 KiB
    h, w = rng.randn(1, n, d).astype(np.float32), (rng.randn(d, v) / 4).astype(np.float32)
    y = rng.randint(0, v, (1, n)).astype(np.int32)

    def temp_bytes(budget):
        f = jax.grad(lambda h: logprobs_and_entropy(h, w, y, chunk_size=64, logits_budget_bytes=budget)[0].sum())
        return jax.jit(f).lower(h).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(n * v * 4) >= n * v * 4
    assert temp_bytes(n * v * 4 - 1) < n * v * 4 / 2


@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("chunk", [64, 100, 300])  # several tiles (100: a ragged last one), one tile
def test_excluded_logsumexp_matches_float64_and_its_gradients_the_masked_logsumexp(layout, chunk):
    """log sum over the vocabulary but each row's k ids (a repeated id excluded once) at temperature 0.8: the
    float64 value, and the gradients of a masked `logsumexp` in both weight layouts, tiled or not."""
    from core.kernels.logprobs import excluded_logsumexp

    h, w, _ = data(3, b=1, t=6, v=300)
    h = h[0]
    n, v = h.shape[0], w.shape[1]
    rng = np.random.RandomState(4)
    exclude = np.stack([rng.choice(v, 5, replace=False) for _ in range(n)]).astype(np.int32)
    exclude[0, 1] = exclude[0, 0]  # a repeat: that id is left out once, the row keeps V - 4 ids
    exclude[1] = [0, 63, 64, 299, 150]  # tile edges
    z = (h.astype(np.float64) @ w.astype(np.float64)) / 0.8
    keep = np.ones((n, v), bool)
    keep[np.arange(n)[:, None], exclude] = False
    want = np.array([np.log(np.exp(z[i][keep[i]]).sum()) for i in range(n)])
    weight = w if layout == "dv" else np.ascontiguousarray(w.T)
    got = excluded_logsumexp(jnp.asarray(h), jnp.asarray(weight), jnp.asarray(exclude), 0.8, chunk, layout)
    steps = np.abs(np.asarray(got, np.float64) - want) / np.spacing(np.abs(want).astype(np.float32))
    assert steps.max() <= 8, steps  # per row, in float32 steps of its value
    assert np.abs(want - np.log(np.exp(z).sum(-1))).min() > 1e-3  # the excluded ids carry visible mass
    g = np.random.RandomState(5).randn(n).astype(np.float32)

    def masked(hh, ww):
        zz = (hh @ ww if layout == "dv" else hh @ ww.T) / 0.8
        return (jax.nn.logsumexp(jnp.where(jnp.asarray(keep), zz, -jnp.inf), axis=-1) * g).sum()

    def tiled(hh, ww):
        return (excluded_logsumexp(hh, ww, jnp.asarray(exclude), 0.8, chunk, layout) * g).sum()

    want_grads = jax.grad(masked, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(weight))
    got_grads = jax.grad(tiled, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(weight))
    for name, a, b in zip(("hidden", "weight"), got_grads, want_grads):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 0, name
        # per tensor, in float32 steps of its largest entry (sums of a tile's products in another order)
        np.testing.assert_allclose(a, b, rtol=0, atol=64 * np.spacing(np.abs(b).max()), err_msg=name)
