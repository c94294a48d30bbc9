"""Pure policy-gradient losses for GRPO / GSPO, their DAPO / Dr.GRPO variants and the objectives of
`posttrain.losses.surrogates` (CISPO, SAPO, GMPO, DPPO) (JAX).

Everything here works on per-token arrays aligned with the completion tokens:

    logp        [B, T]  log pi_theta(y_t) under the policy being trained (carries the gradient)
    old_logp    [B, T]  the same under the policy that started this step (pi_old; constant)
    sampler_logp[B, T]  what the sampler reported for the tokens it drew (vLLM / JAX sampler)
    ref_logp    [B, T]  the reference policy, only when beta > 0
    advantages  [B] or [B, T]   one per completion (GRPO's group advantages) or one per token (on-policy
                        distillation's per-token reverse KL)
    mask        [B, T]  1 on completion tokens whose policy term counts
    kl_mask     [B, T]  1 on completion tokens whose KL term counts (beta > 0; default: mask)

Ratios
    GRPO   r_t = exp(logp_t - old_logp_t)                                    (token level)
    GSPO   s   = exp(mean_t(logp_t - old_logp_t)) per sequence; broadcast to tokens as
           s_t = sg(s) * exp(logp_t - sg(logp_t)), whose value is s and whose gradient is
           s * d logp_t: the sequence ratio's gradient, spread over its tokens.
objective  loss_t = one of `posttrain.losses.surrogates` (`rl.loss.type`; PPO's clip by default:
           max(-A r_t, -A clip(r_t, 1 - epsilon, 1 + epsilon_high)), DAPO's epsilon_high > epsilon, dual clip)
correction loss_t *= w_t, the sampler/trainer mismatch's importance weight, truncated or masked at the token,
           sequence or geometric-mean level (`posttrain.losses.correction`, `rl.rollout_correction`; constant)
entropy    loss -= entropy_coef * (the policy's mean entropy over the counted tokens): an exploration bonus whose
           size does not depend on the aggregation (TRL's `entropy_coef`; within a micro-batch, weighted by its
           share of the denominator, so exact with one micro-batch and with equal shares)
KL         loss_t += beta * k(logp_t, ref_logp_t) on the kl_mask tokens, k one of the estimators of
           `posttrain.losses.kl` (k3 by default, whose gradient follows KL(pi_ref || pi_theta))

`policy_loss` returns `(loss_sum, denominator, PolicyTerms)` in the core
train-step contract (sums over the micro-batch; the step divides once by the
global denominator, so micro-batching is exact); `PolicyTerms` sums the
statistics a step reports (clipped tokens, the correction's weight and what it masked, the KL).
A token counts when its policy or its KL term
does (m = max(mask, kl_mask)); n_i = sum_t m_it:

    token-mean                     sum_it loss / sum_it m           (counted tokens in the whole batch)
    sequence-mean-token-mean       sum_i (sum_t loss / n_i) / #{i: n_i > 0}   (sequences with a counted token)
    sequence-mean-token-sum-norm   sum_it loss / (B * max_tokens)   (Dr.GRPO: B = every episode in the
                                   batch, counted or not, so the step size never depends on filtering)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp

from core.sums import maximum, summed
from posttrain.losses.correction import CorrectionSettings, rollout_correction
from posttrain.losses.kl import KLEstimator, kl_penalty
from posttrain.losses.surrogates import POLICY_LOSSES, Surrogate

LossAgg = Literal["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"]
Algorithm = Literal["grpo", "gspo"]


@dataclass(frozen=True)
class PolicyLossSettings:
    algorithm: Algorithm = "grpo"  # the ratio's level: per token (grpo) or per sequence (gspo)
    type: str = "clip"  # the objective, a name in `surrogates.POLICY_LOSSES`
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    dual_clip: float | None = None
    cispo_cap: float = 5.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dppo_delta: float = 0.15
    dppo_cap: float = 20.0
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient (0: none)
    entropy_adaptive: bool = False  # the coefficient comes with each batch (adaptive entropy control)
    beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    loss_agg: LossAgg = "token-mean"
    max_tokens: int = 1  # Dr.GRPO's constant normaliser (the generation budget)
    # Dr.GRPO's B per micro-batch: the episodes it holds (an agent's earlier segments and the empty sequences that pad
    # them are not episodes, so the step size does not depend on them); None: its sequences
    sequences: int | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PolicyTerms:
    """Token sums over a micro-batch that describe the policy term (each 0 where its part is off): a
    `core.sums` record, summed over micro-batches."""

    clipped_tokens: Any = summed()  # counted tokens the objective's trust region acted on
    completion_tokens: Any = summed()  # tokens whose policy term counts
    correction_weight: Any = summed()  # the rollout correction's weights over the counted tokens
    correction_masked: Any = summed()  # counted tokens the correction masked out
    correction_truncated: Any = summed()  # counted tokens whose weight the correction truncated
    correction_masked_sequences: Any = summed()  # sequences with a counted token, every one masked out
    correction_truncated_sequences: Any = summed()  # sequences with a counted token whose weight was truncated
    correction_ratio: Any = summed()  # the ratio (before truncation or masking) over the counted tokens
    sequences: Any = summed()  # sequences with a counted token
    # The correction's ratio (exp of its log weight at its level, before truncation or masking) over counted tokens
    correction_ratio_max: Any = maximum()
    correction_ratio_min_neg: Any = maximum()  # minus the smallest (a max field)
    # The objective's ratio pi_theta / pi_old (GSPO's sequence ratio) over the counted tokens: how far the update
    # has moved from pi_old (1 at a step's first update; later updates, mini-batches, are off-policy).
    ratio: Any = summed()
    ratio_max: Any = maximum()
    ratio_min_neg: Any = maximum()  # minus the smallest (a max field)
    kl: Any = summed()  # the KL estimator over the KL tokens (beta 0: 0)
    kl_tokens: Any = summed()


def importance_ratio(logp, old_logp, mask, algorithm: str) -> jax.Array:
    """[B, T] ratio pi_theta / pi_old per token (GRPO) or the broadcast sequence ratio (GSPO)."""
    if algorithm == "grpo":
        return jnp.exp(logp - old_logp)
    if algorithm == "gspo":
        n = jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
        seq_log_ratio = ((logp - old_logp) * mask).sum(axis=-1, keepdims=True) / n  # [B, 1]
        return jnp.exp(jax.lax.stop_gradient(seq_log_ratio) + logp - jax.lax.stop_gradient(logp))
    raise ValueError(f"unknown algorithm {algorithm!r}")


def aggregate(
    per_token: jax.Array, mask: jax.Array, mode: LossAgg, max_tokens: int, sequences: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """(sum over the micro-batch, its share of the global denominator); see the module docstring.
    `per_token` is already zero where `mask` (the counted tokens) is; `sequences`: Dr.GRPO's B (None: the rows of
    `per_token`)."""
    lengths = mask.sum(axis=-1)  # [B]
    token_sums = per_token.sum(axis=-1)  # [B]
    if mode == "token-mean":
        return token_sums.sum(), mask.sum()
    if mode == "sequence-mean-token-mean":
        return (token_sums / jnp.maximum(lengths, 1.0)).sum(), (lengths > 0).sum().astype(jnp.float32)
    if mode == "sequence-mean-token-sum-norm":  # a constant: every sequence of the micro-batch, counted or not
        if sequences is not None and per_token.shape[0] % sequences:  # at trace time: a batch it was not made for
            raise ValueError(
                f"Dr.GRPO's {sequences} episodes a micro-batch do not divide its {per_token.shape[0]} sequences (an "
                "episode's segments and their padding come in multiples of its episodes)"
            )
        b = per_token.shape[0] if sequences is None else sequences
        return token_sums.sum(), jnp.asarray(b * max_tokens, jnp.float32)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    settings: PolicyLossSettings,
    sampler_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    kl_mask: jax.Array | None = None,
    entropy: jax.Array | None = None,
    entropy_coef: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, PolicyTerms]:
    """`(loss_sum, denominator, terms)` over the micro-batch (see the module docstring); `entropy` [B, T]: the
    policy's per-token entropy, with its gradient (needed when `entropy_coef` > 0); `entropy_coef`: the batch's
    coefficient (adaptive entropy control; None: the settings')."""
    if settings.type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {settings.type!r}; known: {', '.join(POLICY_LOSSES)}")
    mask = mask.astype(jnp.float32)
    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    sampler = None if sampler_logp is None else sampler_logp.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    adv = adv[:, None] if adv.ndim == 1 else adv  # [B, 1] per sequence or [B, T] per token
    ratio = importance_ratio(logp, old_logp, mask, settings.algorithm)
    per_token, acted = POLICY_LOSSES[settings.type](Surrogate(logp, old_logp, sampler, ratio, adv, mask), settings)
    rows = (mask.sum(-1) > 0).astype(jnp.float32)
    # Without the sampler's log-probs there is no mismatch to correct: `off` (weight 1, nothing masked).
    mode = settings.correction if sampler is not None else CorrectionSettings("off")
    c = rollout_correction(old_logp, old_logp if sampler is None else sampler, mask, mode)
    per_token = per_token * c.weight
    ratio_seen = jnp.exp(jnp.clip(c.log_ratio, -80.0, 80.0))
    all_masked = (c.masked.sum(-1) >= mask.sum(-1)) & (rows > 0)
    correction = dict(
        correction_weight=(c.weight * mask).sum(),
        correction_masked=c.masked.sum(),
        correction_truncated=c.truncated.sum(),
        correction_masked_sequences=all_masked.sum().astype(jnp.float32),
        correction_truncated_sequences=((c.truncated.sum(-1) > 0) & (rows > 0)).sum().astype(jnp.float32),
        correction_ratio=(ratio_seen * mask).sum(),
        correction_ratio_max=jnp.where(mask > 0, ratio_seen, 0.0).max(),
        correction_ratio_min_neg=jnp.where(mask > 0, -ratio_seen, -jnp.inf).max(),
    )
    per_token = per_token * mask
    counted = mask
    kl_sum = kl_tokens = jnp.zeros((), jnp.float32)
    if settings.beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference log-probs (ref_logp)")
        kl_mask = mask if kl_mask is None else kl_mask.astype(jnp.float32)
        kl = kl_penalty(logp, ref_logp.astype(jnp.float32), settings.kl_estimator)
        per_token = per_token + settings.beta * kl * kl_mask
        counted = jnp.maximum(mask, kl_mask)
        kl_sum, kl_tokens = (kl * kl_mask).sum(), kl_mask.sum()
    loss_sum, denominator = aggregate(per_token, counted, settings.loss_agg, settings.max_tokens, settings.sequences)
    if settings.entropy_coef or settings.entropy_adaptive:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the policy's entropy")
        coef = settings.entropy_coef if entropy_coef is None else entropy_coef
        # minus coef * the token mean of the entropy, in the sum the step divides by the whole denominator
        mean_entropy = (entropy.astype(jnp.float32) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        loss_sum = loss_sum - coef * mean_entropy * denominator
    seen = jax.lax.stop_gradient(ratio)
    terms = PolicyTerms(
        ratio=(seen * mask).sum(),
        ratio_max=jnp.where(mask > 0, seen, 0.0).max(),
        ratio_min_neg=jnp.where(mask > 0, -seen, -jnp.inf).max(),
        clipped_tokens=(acted * mask).sum(),
        completion_tokens=mask.sum(),
        sequences=rows.sum(),
        kl=kl_sum,
        kl_tokens=kl_tokens,
        **correction,
    )
    return loss_sum, denominator, terms
