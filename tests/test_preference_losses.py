"""DPO-family losses against an independent float64 NumPy reference: values, gradients (central differences of
the reference), label smoothing, extreme margins, and the settings that must be refused."""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses.preference import LOSS_TYPES, dpo_loss


def np_log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def np_sigmoid(x):
    return np.exp(np_log_sigmoid(x))


def np_losses(pc, pr, rc, rr, nc, nr, loss_type, beta, e, gamma, rpo_alpha):
    """Straight from the papers' formulas (and TRL's variants), in float64."""
    nll = -pc / nc
    if loss_type in ("ipo", "simpo", "orpo"):
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        out = -(1 - e) * np_log_sigmoid(beta * h) - e * np_log_sigmoid(-beta * h)
    elif loss_type == "robust":
        out = (-(1 - e) * np_log_sigmoid(beta * h) + e * np_log_sigmoid(-beta * h)) / (1 - 2 * e)
    elif loss_type == "hinge":
        out = np.maximum(0.0, 1 - beta * h)
    elif loss_type == "ipo":
        out = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "exo_pair":
        eps = e or 1e-3
        z = beta * h
        out = np_sigmoid(z) * (np_log_sigmoid(z) - np.log(1 - eps)) + np_sigmoid(-z) * (
            np_log_sigmoid(-z) - np.log(eps)
        )
    elif loss_type == "simpo":
        z = beta * (pc - pr) - gamma
        out = -(1 - e) * np_log_sigmoid(z) - e * np_log_sigmoid(-z)
    else:  # orpo: odds(p) = p / (1 - p) on the mean per-token probability
        log_odds = (pc - np.log(-np.expm1(pc))) - (pr - np.log(-np.expm1(pr)))
        out = -pc - beta * np_log_sigmoid(log_odds)
    if loss_type in ("simpo", "orpo"):
        rewards = beta * pc, beta * pr
    else:
        rewards = beta * (pc - rc), beta * (pr - rr)
    return out + rpo_alpha * nll, rewards


def pairs(seed, p=16, scale=1.0):
    rng = np.random.default_rng(seed)
    nc, nr = rng.integers(3, 40, p).astype(np.float64), rng.integers(3, 40, p).astype(np.float64)
    # per-token log-probs around -1.5, references near the policy: margins of a few nats
    pc, pr = -nc * rng.uniform(0.5, 2.5, p), -nr * rng.uniform(0.5, 2.5, p)
    rc, rr = pc + scale * rng.normal(0, 2, p), pr + scale * rng.normal(0, 2, p)
    return pc, pr, rc, rr, nc, nr


SETTINGS = [
    ("sigmoid", 0.0),
    ("sigmoid", 0.2),
    ("robust", 0.0),
    ("robust", 0.2),
    ("hinge", 0.0),
    ("ipo", 0.0),
    ("exo_pair", 0.0),
    ("exo_pair", 0.1),
    ("simpo", 0.0),
    ("simpo", 0.1),
    ("orpo", 0.0),
]


def test_every_loss_type_has_a_setting_here():
    assert sorted({t for t, _ in SETTINGS}) == sorted(LOSS_TYPES)


@pytest.mark.parametrize("rpo_alpha", [0.0, 0.7])
@pytest.mark.parametrize("loss_type,e", SETTINGS)
def test_values_and_gradients_match_numpy(loss_type, e, rpo_alpha):
    pc, pr, rc, rr, nc, nr = (
        x.astype(np.float32).astype(np.float64)  # what float32 can hold: the reference sees the same inputs
        for x in pairs(zlib.crc32(f"{loss_type}{e}".encode()))  # a fixed seed per setting
    )
    beta, gamma = 0.3, 0.4
    kw = dict(loss_type=loss_type, beta=beta, label_smoothing=e, gamma=gamma, rpo_alpha=rpo_alpha)
    ref_free = loss_type in ("simpo", "orpo")
    refs = (None, None) if ref_free else (rc, rr)
    out = dpo_loss(pc, pr, *refs, chosen_tokens=nc, rejected_tokens=nr, **kw)
    want, (want_c, want_r) = np_losses(pc, pr, rc, rr, nc, nr, loss_type, beta, e, gamma, rpo_alpha)
    # float32 steps of the largest intermediate of each pair (the log-prob differences, the result)
    scale = np.maximum.reduce([np.abs(want), np.abs(pc - rc), np.abs(pr - rr), np.abs(pc - pr), np.ones_like(pc)])
    tolerance = 16 * np.spacing(scale.astype(np.float32)).astype(np.float64)
    for got, ref in ((out.losses, want), (out.chosen_rewards, want_c), (out.rejected_rewards, want_r)):
        np.testing.assert_array_less(np.abs(np.asarray(got) - ref), tolerance)
    if loss_type == "hinge":  # the branch: some pairs on each side of the hinge
        z = 1 - beta * ((pc - rc) - (pr - rr))
        assert (z > 0).any() and (z < 0).any()

    # gradients w.r.t. the policy's log-probs, weighted by random cotangents
    w = np.random.default_rng(1).normal(size=pc.shape)
    grad = jax.grad(
        lambda a, b: (dpo_loss(a, b, *refs, chosen_tokens=nc, rejected_tokens=nr, **kw).losses * w).sum(),
        argnums=(0, 1),
    )(jnp.asarray(pc, jnp.float32), jnp.asarray(pr, jnp.float32))
    h = 1e-5
    for k, got in enumerate(grad):
        num = np.zeros_like(pc)
        for i in range(len(pc)):
            up, down = [pc.copy(), pr.copy()], [pc.copy(), pr.copy()]
            up[k][i] += h
            down[k][i] -= h
            f = lambda a: (np_losses(*a, rc, rr, nc, nr, loss_type, beta, e, gamma, rpo_alpha)[0] * w).sum()
            num[i] = (f(up) - f(down)) / (2 * h)
        np.testing.assert_allclose(np.asarray(got), num, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_extreme_margins_stay_finite(loss_type):
    """Margins of +-1e4 nats: log-sigmoid forms, no exp overflow, finite values and gradients."""
    pc = np.array([-1.0, -1e4, -5.0, -2e4])
    pr = np.array([-1e4, -1.0, -2e4, -5.0])
    nc = nr = np.array([1.0, 1.0, 10.0, 10.0])
    rc, rr = pc * 0 - 3.0, pr * 0 - 3.0
    refs = (None, None) if loss_type in ("simpo", "orpo") else (rc, rr)
    kw = dict(loss_type=loss_type, beta=0.5, chosen_tokens=nc, rejected_tokens=nr)
    out = dpo_loss(pc, pr, *refs, **kw)
    assert np.isfinite(np.asarray(out.losses)).all()
    grad = jax.grad(lambda a, b: dpo_loss(a, b, *refs, **kw).losses.sum(), argnums=(0, 1))(
        jnp.asarray(pc, jnp.float32), jnp.asarray(pr, jnp.float32)
    )
    assert all(np.isfinite(np.asarray(g)).all() for g in grad)
    if loss_type == "sigmoid":  # -log_sigmoid(x) -> 0 for x -> +inf and -> -x for x -> -inf
        losses = np.asarray(out.losses)
        assert losses[0] < 1e-30 and math.isclose(losses[1], 0.5 * (1e4 - 1.0), rel_tol=1e-6)


def test_orpo_at_a_mean_log_prob_of_zero_is_finite():
    out = dpo_loss(np.array([0.0]), np.array([-3.0]), loss_type="orpo", chosen_tokens=[4], rejected_tokens=[4])
    assert np.isfinite(np.asarray(out.losses)).all()


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(loss_type="kto"), "not one of"),
        (dict(beta=0.0), "beta must be > 0"),
        (dict(label_smoothing=0.5), r"\[0, 0.5\)"),
        (dict(loss_type="hinge", label_smoothing=0.1), "no label smoothing"),
        (dict(loss_type="ipo"), "needs chosen_tokens"),
        (dict(rpo_alpha=1.0), "needs chosen_tokens"),
    ],
)
def test_settings_it_cannot_use_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        dpo_loss(np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2), **kw)


def test_a_reference_loss_without_reference_log_probs_is_refused():
    with pytest.raises(ValueError, match="needs the reference log-probs"):
        dpo_loss(np.zeros(2), np.zeros(2), loss_type="sigmoid")
