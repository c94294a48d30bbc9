"""The vocabulary-chunked divergence equals the naive one (both models' full logits) in value and in its gradient
with respect to the student's hidden states and output weight, for every divergence, both weight layouts, a
vocabulary the chunk does not divide, and a teacher with padded extra rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.kernels.divergence import chunked_divergence, naive_divergence
from tests.helpers import assert_same_gradients

N, DS, DT, V = 24, 16, 24, 203  # 203 = 3 chunks of 64 and a last one that overlaps


def inputs(seed=0, layout_s="dv", layout_t="dv", teacher_extra=0):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.normal(0, 1.0, shape), jnp.float32)
    w_s = f(DS, V) / 2 if layout_s == "dv" else f(V, DS) / 2
    w_t = f(DT, V + teacher_extra) / 2 if layout_t == "dv" else f(V + teacher_extra, DT) / 2
    return f(N, DS), w_s, f(N, DT), w_t


CASES = [("forward", 1.0, 0.5), ("reverse", 2.0, 0.5), ("jsd", 0.7, 0.3)]


@pytest.mark.parametrize("kind,temperature,beta", CASES)
@pytest.mark.parametrize("layout_s,layout_t", [("dv", "dv"), ("vd", "dv"), ("dv", "vd")])
def test_chunked_equals_naive_in_value_and_gradient(kind, temperature, beta, layout_s, layout_t):
    h_s, w_s, h_t, w_t = inputs(layout_s=layout_s, layout_t=layout_t)
    weights = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, N), jnp.float32)  # a per-token cotangent

    def loss(fn, hs, ws):
        return (weights * fn(hs, ws, h_t, w_t, kind, temperature, beta, layout_s=layout_s, layout_t=layout_t)).sum()

    chunked = lambda *a, **k: chunked_divergence(*a, chunk_size=64, **k)
    (v_naive, g_naive), (v_chunk, g_chunk) = (
        jax.jit(jax.value_and_grad(lambda hs, ws, fn=fn: loss(fn, hs, ws), argnums=(0, 1)))(h_s, w_s)
        for fn in (naive_divergence, chunked)
    )
    assert float(v_naive) > 1e-2  # a real divergence
    assert float(v_chunk) == pytest.approx(float(v_naive), rel=1e-5)
    per_token = np.asarray(chunked(h_s, w_s, h_t, w_t, kind, temperature, beta, layout_s=layout_s, layout_t=layout_t))
    want = np.asarray(naive_divergence(h_s, w_s, h_t, w_t, kind, temperature, beta, layout_s, layout_t))
    np.testing.assert_allclose(per_token, want, rtol=2e-5, atol=1e-7)
    # dh_s and dW_s, each in float32 steps of its own scale (the two sum in other orders: measured up to ~72)
    assert_same_gradients(g_naive, g_chunk, steps=128)


def test_a_teachers_padded_rows_are_ignored():
    """A teacher with 13 more output rows than the student's vocabulary (Qwen2.5 7B's 152,064 against 151,936):
    the divergence is over the student's vocabulary, the extra rows never reach it."""
    h_s, w_s, h_t, w_t = inputs(teacher_extra=13)
    got = chunked_divergence(h_s, w_s, h_t, w_t, "forward", chunk_size=64)
    np.testing.assert_allclose(got, naive_divergence(h_s, w_s, h_t, w_t[:, :V], "forward"), rtol=2e-5)
    loud = w_t.at[:, V:].set(100.0)  # whatever the padding holds
    np.testing.assert_allclose(chunked_divergence(h_s, w_s, h_t, loud, "forward", chunk_size=64), got, rtol=1e-6)
    with pytest.raises(ValueError, match="fewer than the student's vocabulary"):
        chunked_divergence(h_s, w_s, h_t, w_t[:, :150], "forward")


def test_the_teacher_gets_no_gradient_and_the_same_model_diverges_by_zero():
    h_s, w_s, _, _ = inputs()
    same = chunked_divergence(h_s, w_s, h_s, w_s, "reverse", chunk_size=64)
    assert float(jnp.abs(same).max()) < 1e-5
    grads = jax.grad(lambda ht: chunked_divergence(h_s, w_s, ht, w_s, "forward", chunk_size=64).sum())(h_s)
    assert not np.asarray(grads).any()


def trl_jsd_cases():
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "fixtures" / "trl_jsd.json").read_text())
    zs = np.asarray(data["student_logits"], np.float32).reshape(-1, 11)
    zt = np.asarray(data["teacher_logits"], np.float32).reshape(-1, 11)
    return [(zs, zt, c["beta"], c["temperature"], np.asarray(c["per_token"]).reshape(-1)) for c in data["cases"]]


@pytest.mark.parametrize("case", range(8))
def test_the_kernels_jsd_is_trls_generalised_jsd(case):
    """The chunked kernel's JSD(beta) per token == TRL's `generalized_jsd_loss` (trl 1.16.0, values stored in
    tests/fixtures/trl_jsd.json: beta 0 and 1 are its forward and reverse KL), at T = 1 and 2; logits given as
    hidden states through an identity output weight, in chunks that do not divide the vocabulary."""
    zs, zt, beta, temperature, want = trl_jsd_cases()[case]
    eye = jnp.eye(11)
    got = chunked_divergence(jnp.asarray(zs), eye, jnp.asarray(zt), eye, "jsd", temperature, beta, chunk_size=4)
    assert (want > 1e-3).all()
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-7)
