"""Rollout correction: the sampler / trainer mismatch as an importance weight on each token's policy loss (pure JAX).

The sampler (vLLM in bfloat16, another kernel, another batch) does not give the tokens it drew the probability the
trainer gives them: the batch is slightly off-policy even before the first update. The weight is the ratio of
pi_old (the trainer's log-probs of the batch, before any update) to the sampler's, at one of three levels, then
truncated into [lo, hi] or masked outside it (`rl.rollout_correction`):

    level      log w                                      over the tokens whose policy term counts (the mask)
    token      log pi_old(y_t) - log pi_sampler(y_t)      per token
    sequence   sum_t (log pi_old - log pi_sampler)        one per sequence (TRL's sequence_*: the ratio of the
                                                          sequence probabilities)
    geometric  mean_t (log pi_old - log pi_sampler)       one per sequence (SkyRL's, verl's geometric mean; what
                                                          GSPO's sequence ratio is)

    truncate   w = clip(exp(log w), lo, hi)               TIS (lo None: no floor)
    mask       w = exp(log w) inside [lo, hi], else 0     MIS / IcePop at the token level: a token (or a whole
                                                          sequence) outside the bounds adds no policy gradient

as TRL's `vllm_importance_sampling_mode` (`token_truncate`, `token_mask`, `sequence_truncate`, `sequence_mask`)
computes it, plus the two geometric modes. The weight is a constant (no gradient). Tokens the mask excludes keep
their KL term (a constraint toward the reference, not a policy estimate).

    c = rollout_correction(old_logp, sampler_logp, mask, CorrectionSettings("sequence_mask", hi=3.0))
    per_token_loss * c.weight      # c.masked / c.truncated: the tokens it acted on; c.log_ratio: for metrics
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

CorrectionMode = Literal[
    "off",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_truncate",
    "geometric_mask",
]


@dataclass(frozen=True)
class CorrectionSettings:
    mode: CorrectionMode = "token_truncate"
    lo: float | None = None  # None: no lower bound
    hi: float | None = 2.0  # None: no upper bound

    @property
    def level(self) -> str:
        return self.mode.split("_")[0]

    @property
    def action(self) -> str:
        return self.mode.split("_")[-1]


@dataclass(frozen=True)
class Correction:
    weight: jax.Array  # [B, T] the importance weight per token (0 where masked), a constant
    masked: jax.Array  # [B, T] 1 on counted tokens the mask excluded (0 when truncating)
    truncated: jax.Array  # [B, T] 1 on counted tokens whose weight was truncated (0 when masking)
    log_ratio: jax.Array  # [B, T] log w before truncation or masking, at the mode's level, broadcast to tokens


# The log weight at each level, [B, T] from the per-token log ratio `d` and the counted tokens `mask`.
LEVELS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {}


def register_level(name: str):
    def add(fn):
        LEVELS[name] = fn
        return fn

    return add


@register_level("token")
def _token(d: jax.Array, mask: jax.Array) -> jax.Array:
    return d


@register_level("sequence")
def _sequence(d: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.broadcast_to((d * mask).sum(-1, keepdims=True), d.shape)


@register_level("geometric")
def _geometric(d: jax.Array, mask: jax.Array) -> jax.Array:
    n = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
    return jnp.broadcast_to((d * mask).sum(-1, keepdims=True) / n, d.shape)


def known_modes() -> list[str]:
    return ["off"] + [f"{level}_{action}" for level in LEVELS for action in ("truncate", "mask")]


def rollout_correction(
    old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, settings: CorrectionSettings
) -> Correction:
    """The weight of every token's policy loss (module docstring); `mask` the tokens whose policy term counts."""
    mask = mask.astype(jnp.float32)
    d = jax.lax.stop_gradient(old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32)) * mask
    if settings.mode == "off":
        return Correction(jnp.ones_like(d), jnp.zeros_like(d), jnp.zeros_like(d), d)
    if settings.level not in LEVELS or settings.action not in ("truncate", "mask"):
        raise ValueError(f"unknown rollout correction {settings.mode!r}; known: {', '.join(known_modes())}")
    log_w = LEVELS[settings.level](d, mask)
    # exp of a sequence's summed log ratio overflows float32 past ~88: bounded in log space first (an absent bound,
    # or a floor of 0, is no bound).
    lo = -jnp.inf if not settings.lo else jnp.log(jnp.float32(settings.lo))
    hi = jnp.inf if settings.hi is None else jnp.log(jnp.float32(settings.hi))
    inside = (log_w >= lo) & (log_w <= hi)
    outside = (~inside).astype(jnp.float32) * mask
    none = jnp.zeros_like(d)
    if settings.action == "truncate":
        return Correction(jnp.exp(jnp.clip(log_w, lo, hi)), none, outside, log_w)
    weight = jnp.where(inside, jnp.exp(jnp.where(inside, log_w, 0.0)), 0.0)
    return Correction(weight, outside, none, log_w)
