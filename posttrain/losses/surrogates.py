"""The policy objectives `rl.loss.type` names, a registry of pure per-token functions (JAX).

Each takes the batch's `Surrogate` (the policy's log-probs with their gradient, pi_old's and the sampler's as
constants, the ratio at the algorithm's level, the advantages, the counted tokens) and the settings, and returns
the per-token loss (before masking and aggregation, which `posttrain.losses.policy.policy_loss` does for all of
them) and which tokens its trust region acted on (the `clip_fraction` it reports). r_t is the ratio
pi_theta / pi_old (GSPO's sequence ratio broadcast to the tokens with `rl.algorithm=gspo`), A the advantage:

    clip   max(-A r, -A clip(r, 1 - eps, 1 + eps_high)); dual clip  min(., -A c) where A < 0   PPO / GRPO / DAPO
    cispo  -sg(min(r, cap)) A log pi_theta     the weight clipped and detached, every token keeps its gradient
                                               (MiniMax-M1; TRL's `cispo`, cap = its epsilon_high, 5.0 by ScaleRL)
    sapo   -(4 / tau) sigmoid(tau (r - 1)) A   a soft gate in place of the hard clip; tau = tau_pos where A > 0,
                                               tau_neg elsewhere (Qwen's SAPO; TRL's `sapo`)
    gmpo   -A exp(mean_t clip_A(log r_t))      the geometric mean of the token ratios, each clipped in log space
                                               to [-eps, eps_high] on the side A pushes it (GMPO; TRL's
                                               experimental GMPOTrainer); a sequence's value on each of its tokens
    dppo   -A sg(min(w, cap)) log pi_theta * valid,  w = pi_theta / pi_sampler;  valid where A > 0 and
           p - p_sampler <= delta, or A <= 0 and p - p_sampler >= -delta (p = exp(log pi_theta): DPPO-Binary-TV,
           the trust region a bound on the probability's move from the policy that sampled the token, not on its
           ratio; verl's `dppo_tv` in its recommended bypass mode, prime-rl's default)

A new objective is a function registered under its name (`@register_policy_loss("name")`); the config accepts the
names registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from posttrain.losses.policy import PolicyLossSettings


@dataclass(frozen=True)
class Surrogate:
    logp: jax.Array  # [B, T] log pi_theta, with its gradient
    old_logp: jax.Array  # [B, T] log pi_old, a constant
    sampler_logp: jax.Array | None  # [B, T] the sampler's, a constant (None: not reported)
    ratio: jax.Array  # [B, T] pi_theta / pi_old at the algorithm's level, with its gradient
    adv: jax.Array  # [B, 1] per sequence or [B, T] per token
    mask: jax.Array  # [B, T] 1 on the tokens whose policy term counts


PolicyLossFn = Callable[[Surrogate, "PolicyLossSettings"], tuple[jax.Array, jax.Array]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return add


@register_policy_loss("clip")
def clip(s: Surrogate, settings: PolicyLossSettings) -> tuple[jax.Array, jax.Array]:
    high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    unclipped = -s.adv * s.ratio
    clipped = -s.adv * jnp.clip(s.ratio, 1.0 - settings.epsilon, 1.0 + high)
    per_token = jnp.maximum(unclipped, clipped)
    if settings.dual_clip is not None:
        per_token = jnp.where(s.adv < 0, jnp.minimum(per_token, -s.adv * settings.dual_clip), per_token)
    return per_token, clipped > unclipped


@register_policy_loss("cispo")
def cispo(s: Surrogate, settings: PolicyLossSettings) -> tuple[jax.Array, jax.Array]:
    weight = jax.lax.stop_gradient(jnp.minimum(s.ratio, settings.cispo_cap))
    return -weight * s.adv * s.logp, s.ratio > settings.cispo_cap


@register_policy_loss("sapo")
def sapo(s: Surrogate, settings: PolicyLossSettings) -> tuple[jax.Array, jax.Array]:
    tau = jnp.where(s.adv > 0, settings.sapo_tau_pos, settings.sapo_tau_neg)
    gate = jax.nn.sigmoid(tau * (s.ratio - 1.0)) * 4.0 / tau
    return -gate * s.adv, jnp.zeros(s.ratio.shape, bool)  # no token is cut off: the gate only softens


@register_policy_loss("gmpo")
def gmpo(s: Surrogate, settings: PolicyLossSettings) -> tuple[jax.Array, jax.Array]:
    log_ratio = s.logp - s.old_logp
    high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    bounded = jnp.clip(log_ratio, -settings.epsilon, high)
    # The pessimistic side, as PPO's min: a positive advantage gains nothing past the upper bound, a negative one
    # nothing past the lower.
    kept = jnp.where(s.adv > 0, jnp.minimum(log_ratio, bounded), jnp.maximum(log_ratio, bounded))
    n = jnp.maximum(s.mask.sum(-1, keepdims=True), 1.0)
    sequence = jnp.exp((kept * s.mask).sum(-1, keepdims=True) / n)  # [B, 1] the geometric mean of clipped ratios
    return -s.adv * sequence * jnp.ones_like(log_ratio), kept != log_ratio


@register_policy_loss("dppo")
def dppo(s: Surrogate, settings: PolicyLossSettings) -> tuple[jax.Array, jax.Array]:
    behaviour = s.old_logp if s.sampler_logp is None else s.sampler_logp
    moved = jnp.exp(s.logp) - jnp.exp(behaviour)
    valid = jax.lax.stop_gradient(jnp.where(s.adv > 0, moved <= settings.dppo_delta, moved >= -settings.dppo_delta))
    weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(s.logp - behaviour), settings.dppo_cap))
    return -s.adv * weight * s.logp * valid, ~valid
