"""Group advantages (group_norm, Dr.GRPO, RLOO; failed and flat groups), the KL estimators' values and the
divergences their gradients follow, and pass@k: each against NumPy or an enumeration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.advantages import group_advantages
from posttrain.losses.kl import kl_penalty


def np_advantages(rewards, g, estimator, eps=1e-4):
    """Advantages, policy keep mask, trainable mask and (flat, failed) group counts; NaN = a failed item."""
    out, keep, trainable, flat_groups, failed_groups = [], [], [], 0, 0
    for start in range(0, len(rewards), g):
        grp = [float(x) for x in rewards[start : start + g]]
        failed = any(x != x for x in grp)  # NaN
        mean = sum(grp) / g
        flat = not failed and all(x == grp[0] for x in grp)
        flat_groups += flat
        failed_groups += failed
        for _i, x in enumerate(grp):
            if flat or failed:
                a = 0.0
            elif estimator == "group_norm":
                std = (sum((y - mean) ** 2 for y in grp) / (g - 1)) ** 0.5
                a = (x - mean) / (std + eps)
            elif estimator == "drgrpo":
                a = x - mean
            else:  # rloo: baseline = mean of the others
                a = x - (sum(grp) - x) / (g - 1)
            out.append(a)
            keep.append(not (flat or failed))
            trainable.append(not failed)
    return np.array(out), np.array(keep), np.array(trainable), flat_groups, failed_groups


@pytest.mark.parametrize("estimator", ["group_norm", "drgrpo", "rloo"])
def test_advantages_match_numpy(estimator):
    rng = np.random.default_rng(0)
    rewards = np.concatenate(
        [
            rng.normal(size=4),  # ordinary group
            [1.0, 1.0, 1.0, 1.0],  # std = 0: masked out
            [0.0, 0.0, 1.0, 0.0],  # binary rewards
            [-2.0, -2.0, -2.0, -2.0],  # another flat group
            [3.0, 3.0 + 1e-9, 3.0, 3.0],  # tiny std: the eps keeps it finite
            [1.0, np.nan, 0.0, 1.0],  # a failed item: the whole group is dropped
            [np.nan, np.nan, np.nan, np.nan],  # a crashed worker's shard
        ]
    )
    adv = group_advantages(rewards, 4, estimator, std_eps=1e-4)
    ref, keep, trainable, flat, failed = np_advantages(rewards, 4, estimator, eps=1e-4)
    np.testing.assert_allclose(adv.values, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(adv.keep, keep)
    np.testing.assert_array_equal(adv.trainable, trainable)
    assert adv.zero_variance_groups == flat == 2 and adv.failed_groups == failed == 2
    assert np.isfinite(adv.values).all()


def test_a_failed_item_drops_its_group_not_its_neighbours():
    """The group's other rewards would be normalised against a missing one: no member keeps an advantage,
    while the next group is untouched (it is normalised as if the failed group were not there)."""
    rewards = np.array([1.0, 0.0, np.nan, 1.0, 0.0, 1.0, 1.0, 0.0])
    adv = group_advantages(rewards, 4)
    assert not adv.values[:4].any() and not adv.keep[:4].any() and not adv.trainable[:4].any()
    np.testing.assert_allclose(adv.values[4:], group_advantages(rewards[4:], 4).values)
    assert adv.keep[4:].all() and adv.failed_groups == 1


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(np.zeros(6), 4)


def test_kl_estimators():
    logp, ref = np.log([0.5, 0.2, 0.9, 1e-3]), np.log([0.4, 0.3, 0.9, 0.9])
    x = logp - ref
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), x, rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), 0.5 * x**2, rtol=1e-6)
    k3 = np.exp(-x) + x - 1
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), k3, rtol=1e-6)
    assert (np.asarray(kl_penalty(logp, ref, "k3")) >= 0).all()
    assert k3[-1] > 10 and k3[:-1].max() < 10  # the last token reaches low_var_kl's clamp, the others do not
    np.testing.assert_allclose(kl_penalty(logp, ref, "low_var_kl"), np.minimum(k3, 10.0), rtol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimator_gradients_follow_the_documented_divergence(estimator):
    """Exact expectations over a 6-token vocabulary, tokens drawn from pi_theta (held fixed, as sampled
    completions are): E[grad k1] = 0, E[grad k2] = grad KL(pi || ref), E[grad k3] = grad KL(ref || pi)
    (the reverse KL, not the one k3's value estimates); low_var_kl = k3 within its clamp."""
    rng = np.random.default_rng(7)
    theta = jnp.asarray(rng.normal(size=6))
    log_ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=6)))

    def expected_loss(t):
        logp = jax.nn.log_softmax(t)
        weights = jax.lax.stop_gradient(jnp.exp(logp))  # the sampling distribution
        return (weights * kl_penalty(logp, log_ref, estimator)).sum()

    def forward_kl(t):  # KL(pi || ref)
        logp = jax.nn.log_softmax(t)
        return (jnp.exp(logp) * (logp - log_ref)).sum()

    def reverse_kl(t):  # KL(ref || pi)
        return (jnp.exp(log_ref) * (log_ref - jax.nn.log_softmax(t))).sum()

    got = np.asarray(jax.grad(expected_loss)(theta))
    want = {
        "k1": np.zeros(6),
        "k2": jax.grad(forward_kl)(theta),
        "k3": jax.grad(reverse_kl)(theta),
        "low_var_kl": jax.grad(reverse_kl)(theta),
    }[estimator]
    assert np.abs(np.asarray(jax.grad(forward_kl)(theta)) - np.asarray(jax.grad(reverse_kl)(theta))).max() > 1e-2
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-6)


# --------------------------------------------- micro-batches on a real model


def test_pass_at_k_matches_enumeration():
    from itertools import combinations

    from posttrain.onpolicy.evaluation import majority_correct, pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                samples = [True] * c + [False] * (n - c)
                subsets = list(combinations(range(n), k))
                expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert majority_correct(["4", " 4", "5", None], [True, True, False, False])
    assert not majority_correct(["5", "5", "4"], [False, False, True])
    assert not majority_correct([None, None], [False, False])
