"""Distillation losses against float64 NumPy references written from the formulas: values, and gradients with
respect to the student (central differences of the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import distill


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_kl(loga, logb):
    a = np.exp(loga)
    return (a * np.where(a > 0, loga - logb, 0.0)).sum(-1)


def np_divergence_of_logprobs(logq, logp, kind, beta):
    if kind == "forward" or (kind == "jsd" and beta == 0):
        return np_kl(logp, logq)
    if kind == "reverse" or (kind == "jsd" and beta == 1):
        return np_kl(logq, logp)
    m = beta * np.exp(logp) + (1 - beta) * np.exp(logq)
    return beta * np_kl(logp, np.log(m)) + (1 - beta) * np_kl(logq, np.log(m))


def np_divergence(zs, zt, kind, temperature, beta):
    return np_divergence_of_logprobs(np_log_softmax(zs / temperature), np_log_softmax(zt / temperature), kind, beta)


def np_topk(logq, logp, kind, mode, beta):
    if mode == "renormalised":
        logq, logp = (
            logq - np.log(np.exp(logq).sum(-1, keepdims=True)),
            logp - np.log(np.exp(logp).sum(-1, keepdims=True)),
        )
    else:
        tail = lambda x: np.concatenate([x, np.log(np.maximum(1 - np.exp(x).sum(-1, keepdims=True), 1e-12))], -1)
        logq, logp = tail(logq), tail(logp)
    return np_divergence_of_logprobs(logq, logp, kind, beta)


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += eps
        down[idx] -= eps
        g[idx] = (f(up) - f(down)) / (2 * eps)
    return g


rng = np.random.default_rng(0)
ZS = rng.normal(0, 2.0, (5, 7))
ZT = rng.normal(0, 2.0, (5, 7))
CASES = [("forward", 1.0, 0.5), ("reverse", 2.0, 0.5), ("jsd", 0.5, 0.3), ("jsd", 1.0, 0.0), ("jsd", 1.5, 1.0)]


@pytest.mark.parametrize("kind,temperature,beta", CASES)
def test_full_vocabulary_divergences_match_numpy(kind, temperature, beta):
    got = distill.divergence(jnp.asarray(ZS, jnp.float32), jnp.asarray(ZT, jnp.float32), kind, temperature, beta)
    want = np_divergence(ZS, ZT, kind, temperature, beta)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert (want > 1e-3).all()  # real divergences, not zeros
    grad = jax.grad(lambda z: distill.divergence(z, jnp.asarray(ZT, jnp.float32), kind, temperature, beta).sum())(
        jnp.asarray(ZS, jnp.float32)
    )
    ref = numeric_grad(lambda z: np_divergence(z, ZT, kind, temperature, beta).sum(), ZS.copy())
    np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-3, atol=1e-5)


def test_jsd_is_trls_generalised_jsd_at_its_ends_and_bounded_between():
    zs, zt = jnp.asarray(ZS, jnp.float32), jnp.asarray(ZT, jnp.float32)
    forward, reverse = distill.divergence(zs, zt, "forward"), distill.divergence(zs, zt, "reverse")
    np.testing.assert_allclose(distill.divergence(zs, zt, "jsd", beta=0.0), forward, rtol=1e-6)
    np.testing.assert_allclose(distill.divergence(zs, zt, "jsd", beta=1.0), reverse, rtol=1e-6)
    half = np.asarray(distill.divergence(zs, zt, "jsd", beta=0.5))
    assert (half > 0).all() and (half <= np.log(2) + 1e-6).all()  # the symmetric JSD is at most log 2
    assert float(np.abs(distill.divergence(zs, zs, "jsd", beta=0.5)).max()) < 1e-6


@pytest.mark.parametrize("mode", ["renormalised", "tail"])
@pytest.mark.parametrize("kind,beta", [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.4)])
def test_topk_divergences_match_numpy(mode, kind, beta):
    k = 4
    logq = np_log_softmax(ZS)[:, :k]  # the student's full-vocabulary log-probs at the teacher's top-k ids
    logp = np_log_softmax(ZT)[:, :k]
    got = distill.topk_divergence(jnp.asarray(logq, jnp.float32), jnp.asarray(logp, jnp.float32), kind, mode, beta)
    np.testing.assert_allclose(np.asarray(got), np_topk(logq, logp, kind, mode, beta), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: distill.topk_divergence(x, jnp.asarray(logp, jnp.float32), kind, mode, beta).sum())(
        jnp.asarray(logq, jnp.float32)
    )
    ref = numeric_grad(lambda x: np_topk(x, logp, kind, mode, beta).sum(), logq.copy())
    np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-3, atol=1e-5)


def test_the_tail_bucket_sees_a_student_leaving_the_topk():
    """A student whose top-k log-probs all drop by the same amount (its mass moved off the top-k) keeps the same
    renormalised distribution: the renormalised reverse KL cannot see it, the tail bucket's does."""
    logp = np.log(np.array([[0.5, 0.3, 0.1]]))
    logq = np.log(np.array([[0.45, 0.3, 0.15]]))
    moved = logq + np.log(0.5)  # half the student's top-k mass gone elsewhere
    for mode, sees in (("renormalised", False), ("tail", True)):
        before, after = (
            float(distill.topk_divergence(jnp.asarray(x), jnp.asarray(logp), "reverse", mode)[0]) for x in (logq, moved)
        )
        assert (abs(after - before) > 1e-2) == sees, (mode, before, after)
    assert float(distill.topk_mass(jnp.asarray(moved))[0]) == pytest.approx(0.45)
    whole = np.log(np.array([[0.6, 0.4]]))  # a top-k holding all the mass: the tail is empty, the loss finite
    assert np.isfinite(float(distill.topk_divergence(jnp.asarray(whole), jnp.asarray(whole), "forward", "tail")[0]))


def test_hard_label_mixing_and_temperature_scaling():
    kd, nll = jnp.asarray([0.2, 0.5]), jnp.asarray([1.0, 3.0])
    np.testing.assert_allclose(distill.mix_hard_label(kd, nll, 0.25, 2.0), 0.75 * 4 * kd + 0.25 * nll, rtol=1e-6)
    np.testing.assert_allclose(distill.mix_hard_label(kd, nll, 0.25, 2.0, False), 0.75 * kd + 0.25 * nll, rtol=1e-6)
    np.testing.assert_allclose(distill.mix_hard_label(kd, nll, 0.0, 1.0), kd, rtol=1e-6)


def test_reverse_kl_advantages_are_minus_the_log_ratio_on_the_sampled_tokens():
    s, t = rng.normal(-2, 1, (3, 4)), rng.normal(-2, 1, (3, 4))
    np.testing.assert_allclose(distill.reverse_kl_advantages(jnp.asarray(s), jnp.asarray(t)), -(s - t), rtol=1e-5)
    task = np.array([1.0, -1.0, 0.5])
    mixed = distill.reverse_kl_advantages(jnp.asarray(s), jnp.asarray(t), jnp.asarray(task), reward_weight=0.5)
    np.testing.assert_allclose(mixed, -(s - t) + 0.5 * task[:, None], rtol=1e-5)


def test_feature_losses_match_numpy_with_and_without_a_projection():
    hs, ht, w = rng.normal(size=(4, 6)), rng.normal(size=(4, 3)), rng.normal(size=(6, 3))
    proj = hs @ w
    cosine = 1 - (proj * ht).sum(-1) / (np.linalg.norm(proj, axis=-1) * np.linalg.norm(ht, axis=-1))
    f = lambda kind: distill.feature_loss(jnp.asarray(hs), jnp.asarray(ht), kind, jnp.asarray(w))
    np.testing.assert_allclose(f("cosine"), cosine, rtol=1e-5)
    np.testing.assert_allclose(f("l2"), ((proj - ht) ** 2).mean(-1), rtol=1e-5)
    grad = jax.grad(lambda p: distill.feature_loss(jnp.asarray(hs), jnp.asarray(ht), "l2", p).sum())(jnp.asarray(w))
    ref = numeric_grad(lambda p: (((hs @ p) - ht) ** 2).mean(-1).sum(), w.copy())
    np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-3, atol=1e-5)
    grad = jax.grad(lambda p: distill.feature_loss(jnp.asarray(hs), jnp.asarray(ht), "cosine", p).sum())(jnp.asarray(w))
    cos_of = lambda p: 1 - ((hs @ p) * ht).sum(-1) / (np.linalg.norm(hs @ p, axis=-1) * np.linalg.norm(ht, axis=-1))
    ref = numeric_grad(lambda p: cos_of(p).sum(), w.copy())
    np.testing.assert_allclose(np.asarray(grad), ref, rtol=1e-3, atol=1e-5)
    with pytest.raises(ValueError, match="student width 6 != teacher width 3: give a projection"):
        distill.feature_loss(jnp.asarray(hs), jnp.asarray(ht), "cosine")
    # A zero vector (a padding position's states): a finite loss and a finite gradient, which a mask then zeroes.
    zeros = jnp.zeros((2, 6))
    masked = lambda p: (distill.feature_loss(zeros, jnp.asarray(ht[:2]), "cosine", p) * 0.0).sum()
    assert np.isfinite(np.asarray(jax.grad(masked)(jnp.asarray(w)))).all()


def test_schedules():
    at = lambda kind, step: float(distill.scheduled(1.0, 0.2, kind, step, 100))
    assert [at("constant", s) for s in (0, 50, 100)] == [1.0, 1.0, 1.0]
    assert [at("linear", s) for s in (0, 50, 100)] == pytest.approx([1.0, 0.6, 0.2])
    assert [at("cosine", s) for s in (0, 50, 100, 200)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    assert at("cosine", 25) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + np.cos(np.pi / 4)))


def test_the_tail_bucket_comes_from_the_logits_outside_the_topk_when_the_topk_holds_all_but_1e_12():
    """A student whose top-k holds all but ~1e-12 of its mass (1 - sum_k rounds to 0 in float32) and a teacher
    that leaves 1% outside: forward KL with a tail bucket should push the student's mass out to the tail (a
    negative gradient on every logit outside the top-k). With the bucket from the logits outside the top-k
    (`excluded_logsumexp`, what the objective passes) the gradient is the float64 one; from 1 - sum_k (the floor)
    that push is gone: what is left is the top-k terms' pull (q_j ~ 1e-12) and rounding, 1e5 times smaller."""
    from core.kernels.logprobs import excluded_logsumexp

    v, k = 12, 3
    rng = np.random.default_rng(3)
    z = np.full((2, v), -14.0) + rng.normal(0, 0.3, (2, v))  # the student's logits
    z[:, :k] = 14.0 + rng.normal(0, 0.3, (2, k))  # its top-k: all but ~1e-11 of the mass
    pt = np.full((2, v), 0.01 / (v - k))
    pt[:, :k] = 0.99 / k  # the teacher: 1% outside the top-k
    logp = np.log(pt[:, :k])
    ids = jnp.tile(jnp.arange(k), (2, 1))
    eye = jnp.eye(v)  # hidden = the logits, the output weight the identity: the kernel sees these logits

    def loss(logits, exact):
        lse = jax.nn.logsumexp(logits, axis=-1)
        logq = logits[:, :k] - lse[:, None]
        tail = excluded_logsumexp(logits, eye, ids) - lse if exact else None
        return distill.topk_divergence(logq, jnp.asarray(logp, jnp.float32), "forward", "tail", student_tail=tail).sum()

    zf = jnp.asarray(z, jnp.float32)
    assert float(jnp.sum(jnp.exp(jax.nn.log_softmax(zf)[:, :k]), -1).min()) == 1.0  # 1 - sum_k is 0 in float32
    # float64 reference: d/dz_j of -sum_k p_k log q_k - p_tail log q_tail = q_j - p_j (top-k),
    # q_j - p_tail * exp(z_j) / sum_{outside} exp(z) (outside)
    q = np.exp(z - z.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    outside = np.exp(z[:, k:] - z[:, k:].max(-1, keepdims=True))
    want = q.copy()
    want[:, :k] -= pt[:, :k]
    want[:, k:] -= 0.01 * outside / outside.sum(-1, keepdims=True)
    exact = np.asarray(jax.grad(lambda x: loss(x, True))(zf))
    floored = np.asarray(jax.grad(lambda x: loss(x, False))(zf))
    np.testing.assert_allclose(exact, want, rtol=1e-4, atol=1e-7)
    assert (exact[:, k:] < -1e-4).all()
    assert np.abs(floored[:, k:]).max() < 1e-3 * np.abs(want[:, k:]).min()  # the floor loses the tail's gradient


def test_jsd_is_trls_generalised_jsd():
    """`divergence(..., "jsd", T, beta)` per token == TRL's `generalized_jsd_loss` (stored values, see
    tests/fixtures/make_trl_jsd.py) for beta 0, 0.3, 0.5, 1 at T = 1 and 2."""
    from tests.test_divergence_kernel import trl_jsd_cases

    for zs, zt, beta, temperature, want in trl_jsd_cases():
        got = distill.divergence(jnp.asarray(zs), jnp.asarray(zt), "jsd", temperature, beta)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-7)
