"""KL estimators between the policy and a reference, per token, on tokens sampled from the policy (pure JAX).

    kl = kl_penalty(logp, ref_logp, "k3")     # [B, T]; x = logp - ref_logp = log pi_theta / pi_ref

    k1          x                  value: unbiased for KL(pi_theta || pi_ref); gradient: zero in expectation
    k2          x^2 / 2            gradient: that of KL(pi_theta || pi_ref)
    k3          exp(-x) + x - 1    value: unbiased for KL(pi_theta || pi_ref), >= 0; gradient: that of
                                   KL(pi_ref || pi_theta), the reverse divergence
    low_var_kl  k3 clamped to [-10, 10] (verl's name): k3's gradient where not clamped

The gradients are expectations over tokens drawn from pi_theta (Schulman,
"Approximating KL divergence"); tests/test_grpo_losses.py checks each one by
enumeration over a small vocabulary.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
LOW_VAR_KL_CLAMP = 10.0


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: KLEstimator) -> jax.Array:
    """Per-token KL estimator on samples of pi_theta (Schulman's k1/k2/k3; which divergence each one's
    gradient follows is in the module docstring)."""
    log_ratio = logp - ref_logp  # log pi_theta / pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator in ("k3", "low_var_kl"):  # r - log r - 1 with r = pi_ref / pi_theta
        k3 = jnp.exp(-log_ratio) + log_ratio - 1.0
        return k3 if estimator == "k3" else jnp.clip(k3, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}")
