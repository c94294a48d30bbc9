"""Pure preference-optimisation losses (DPO and its family) of per-sequence log-probs (JAX).

    out = dpo_loss(pc, pr, rc, rr, loss_type="sigmoid", beta=0.1, chosen_tokens=nc, rejected_tokens=nr)
    out.losses, out.chosen_rewards, out.rejected_rewards      # [P] each, one per pair

Inputs, one entry per pair:

    pc, pr   log pi_theta(chosen | prompt), log pi_theta(rejected | prompt): sums over each completion's tokens
    rc, rr   the same under the frozen reference (None for the reference-free `simpo` and `orpo`)
    nc, nr   the completions' token counts (needed by `ipo`, `simpo`, `orpo` and `rpo_alpha`)

With lp = pc, pr, rc, rr (summed) or each divided by its token count
("length-normalised": `ipo`, `simpo`, `orpo`), h = (pc - rc) - (pr - rr),
b = beta, e = label_smoothing and log_sigmoid(x) = -log(1 + exp(-x)) (computed
without overflow for any x):

    sigmoid   -(1 - e) log_sigmoid(b h) - e log_sigmoid(-b h)         DPO (Rafailov et al. 2023); e > 0 is
                                                                      conservative DPO (cDPO)
    robust    (-(1 - e) log_sigmoid(b h) + e log_sigmoid(-b h)) / (1 - 2e)     robust DPO (Chowdhury et al. 2024)
    hinge     max(0, 1 - b h)                                          SLiC (Zhao et al. 2023)
    ipo       (h - 1 / (2 b))^2, on length-normalised log-probs        IPO (Azar et al. 2023), as TRL does
    exo_pair  sigmoid(b h) (log_sigmoid(b h) - log(1 - e)) + sigmoid(-b h) (log_sigmoid(-b h) - log e),
              e = 1e-3 when label_smoothing is 0                       EXO (Ji et al. 2024)
    simpo     -(1 - e) log_sigmoid(b (pc - pr) - gamma) - e log_sigmoid(-(b (pc - pr) - gamma)),
              length-normalised, no reference                          SimPO (Meng et al. 2024)
    orpo      -pc - b log_sigmoid(log_odds), log_odds = (pc - pr) - (log(1 - e^pc) - log(1 - e^pr)),
              length-normalised, no reference                          ORPO (Hong et al. 2024)

Implicit rewards: b (pc - rc) and b (pr - rr) (b pc and b pr without a
reference), on the log-probs the loss used. `rpo_alpha` > 0 adds
rpo_alpha x (the chosen completion's mean NLL, -pc / nc) to every loss type
(RPO, Pang et al. 2024). TRL averages that NLL over the batch's chosen tokens
instead; here it is per pair, so that a batch's loss is a mean over pairs and
micro-batching leaves the gradient unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp

LossType = Literal["sigmoid", "robust", "ipo", "hinge", "exo_pair", "simpo", "orpo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
REFERENCE_FREE: tuple[str, ...] = ("simpo", "orpo")  # no reference model is loaded for these
LENGTH_NORMALISED: tuple[str, ...] = ("ipo", "simpo", "orpo")
SMOOTHED: tuple[str, ...] = ("sigmoid", "robust", "exo_pair", "simpo")  # the types that read label_smoothing
EXO_DEFAULT_EPSILON = 1e-3
ORPO_MAX_LOGP = -1e-6  # log(1 - e^x) is -inf at x = 0: a mean log-prob is capped just below it


@dataclass(frozen=True)
class PreferenceLoss:
    losses: jax.Array  # [P]
    chosen_rewards: jax.Array  # [P] the implicit reward of the chosen completion
    rejected_rewards: jax.Array  # [P]


def check_settings(loss_type: str, beta: float, label_smoothing: float) -> None:
    """ValueError naming the setting that `dpo_loss` cannot use."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing > 0 and loss_type not in SMOOTHED:
        raise ValueError(f"loss_type {loss_type!r} has no label smoothing (only {', '.join(SMOOTHED)} do)")


def dpo_loss(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array | None = None,
    ref_rejected_logps: jax.Array | None = None,
    *,
    loss_type: LossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    rpo_alpha: float = 0.0,
    chosen_tokens: jax.Array | None = None,
    rejected_tokens: jax.Array | None = None,
) -> PreferenceLoss:
    """Per-pair losses and implicit rewards (formulas in the module docstring)."""
    check_settings(loss_type, beta, label_smoothing)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    pc, pr = f32(policy_chosen_logps), f32(policy_rejected_logps)
    needs_lengths = loss_type in LENGTH_NORMALISED or rpo_alpha > 0
    if needs_lengths and (chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"loss_type {loss_type!r} (or rpo_alpha > 0) needs chosen_tokens and rejected_tokens")
    nc = jnp.maximum(f32(chosen_tokens), 1.0) if chosen_tokens is not None else None
    nr = jnp.maximum(f32(rejected_tokens), 1.0) if rejected_tokens is not None else None
    nll = -pc / nc if rpo_alpha > 0 and nc is not None else None  # before length normalisation: always a mean
    if loss_type in LENGTH_NORMALISED:
        assert nc is not None and nr is not None
        pc, pr = pc / nc, pr / nr
    e = label_smoothing
    log_sigmoid = jax.nn.log_sigmoid

    if loss_type in REFERENCE_FREE:
        chosen_rewards, rejected_rewards = beta * pc, beta * pr
        if loss_type == "simpo":
            z = beta * (pc - pr) - gamma
            losses = -(1 - e) * log_sigmoid(z) - e * log_sigmoid(-z)
        else:  # orpo
            cap = lambda x: jnp.minimum(x, ORPO_MAX_LOGP)
            log_odds = (pc - pr) - (_log1m_exp(cap(pc)) - _log1m_exp(cap(pr)))
            losses = -pc - beta * log_sigmoid(log_odds)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type {loss_type!r} needs the reference log-probs (only simpo and orpo do not)")
        rc, rr = f32(ref_chosen_logps), f32(ref_rejected_logps)
        if loss_type in LENGTH_NORMALISED:
            assert nc is not None and nr is not None
            rc, rr = rc / nc, rr / nr
        h = (pc - rc) - (pr - rr)
        chosen_rewards, rejected_rewards = beta * (pc - rc), beta * (pr - rr)
        if loss_type == "sigmoid":
            losses = -(1 - e) * log_sigmoid(beta * h) - e * log_sigmoid(-beta * h)
        elif loss_type == "robust":
            losses = (-(1 - e) * log_sigmoid(beta * h) + e * log_sigmoid(-beta * h)) / (1 - 2 * e)
        elif loss_type == "hinge":
            losses = jax.nn.relu(1 - beta * h)
        elif loss_type == "ipo":
            losses = (h - 1 / (2 * beta)) ** 2
        else:  # exo_pair
            eps = e if e > 0 else EXO_DEFAULT_EPSILON
            z = beta * h
            losses = jax.nn.sigmoid(z) * (log_sigmoid(z) - math.log(1 - eps)) + jax.nn.sigmoid(-z) * (
                log_sigmoid(-z) - math.log(eps)
            )
    if nll is not None:
        losses = losses + rpo_alpha * nll
    return PreferenceLoss(losses, chosen_rewards, rejected_rewards)


def _log1m_exp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it (Maechler 2012)."""
    return jnp.where(x > -math.log(2), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))
