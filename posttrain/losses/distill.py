"""Pure teacher-student distillation losses (JAX): per-token values, reduced by the caller over the loss tokens.

    kd = divergence(student_logits, teacher_logits, "jsd", temperature=2.0, beta=0.5)    # [N] per token
    kd = topk_divergence(student_logq, teacher_logp, "reverse", mode="tail")            # [N], on the teacher's top-k
    loss = mix_hard_label(kd, nll, alpha=0.1, temperature=2.0, temperature_scale=True)  # [N]
    adv = reverse_kl_advantages(student_logp, teacher_logp)                          # [B, T] on-policy advantages
    f = feature_loss(student_hidden, teacher_hidden, "cosine", projection=w)          # [N]
    alpha = scheduled(0.5, 0.0, "cosine", step, total)                               # a hyper-parameter at a step

With p the teacher's and q the student's next-token distribution at temperature T (softmax(z / T)), per token:

    forward   KL(p || q) = sum_v p_v (log p_v - log q_v)     (Hinton et al., 2015; mean-seeking)
    reverse   KL(q || p) = sum_v q_v (log q_v - log p_v)     (MiniLLM, Gu et al., 2024; mode-seeking)
    jsd       beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q: TRL's GKD generalised JSD
              (Agarwal et al., 2024), with beta = 0 read as forward KL and beta = 1 as reverse KL, as TRL does

On the teacher's top-k (what an offline dump stores: `teacher_logp` its log-probs over the whole vocabulary at
those k ids, `student_logq` the student's at the same ids):

    mode "renormalised"   both renormalised over the k ids (MaxText, Tunix, NeMo-RL): the divergence between the
                          two distributions conditioned on the top-k; it cannot see mass the student puts elsewhere
    mode "tail"           the k ids plus one bucket holding the rest of the mass (TRL's server distillation,
                          `loss_add_tail`): mass the student moves off the top-k is penalised. Reverse KL over the
                          top-k alone lets the student shrink its own mass there unseen (verl found it unstable); the
                          tail bucket closes that hole. The training objective takes the student's bucket (and, in
                          the step, the teacher's) from the logits outside the top-k, not from 1 - sum_k: that
                          difference rounds to 0 in float32 once the top-k hold nearly all the mass.

Temperature: both sides at T (top-k: the caller passes log-probs at T; renormalising makes a dump's T = 1 values
exact at any T, the tail bucket needs values taken at T). `mix_hard_label` multiplies the divergence by T^2 with
`temperature_scale` (Hinton's: the soft loss's gradient scales as 1/T^2, so without it raising T silently lowers
the distillation term's weight against the hard-label one); on by default, a no-op at T = 1. It mixes in the
hard-label NLL with weight alpha: (1 - alpha) T^2 KD + alpha NLL.

On-policy distillation scores the student's own samples: the advantage of sampled token x_t is
-(log q(x_t) - log p(x_t)), the per-token reverse KL on the sampled token, optionally plus a task reward's advantage
(Qwen3's and Thinking Machines' recipe), trained with the policy-gradient loss of `posttrain.losses.policy`.

Every function upcasts to float32 and returns per-token (or per-sequence) values; `tests/test_distill_losses.py`
checks each against an independent float64 NumPy reference, values and gradients.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from core.kernels.divergence import Divergence, divergence_of_logprobs

TopKMode = Literal["renormalised", "tail"]
Schedule = Literal["constant", "linear", "cosine"]
FeatureKind = Literal["cosine", "l2"]
_TAIL_FLOOR = 1e-12  # a tail of exactly 0 mass (the top-k holds it all) stays a finite log
_NORM_FLOOR = 1e-24  # under a squared norm: a zero vector's cosine loss is 1 with a finite (zero) gradient


def divergence(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    kind: Divergence,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> jax.Array:
    """[..., V] logits of both models -> [...] divergence of their distributions at `temperature`. (The
    vocabulary-chunked kernel, `core.kernels.divergence.chunked_divergence`, gives the same from hidden states and
    output weights without [N, V] logits; the terms are `core.kernels.divergence.divergence_of_logprobs`.)"""
    logq = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    return divergence_of_logprobs(logq, logp, kind, beta)


def _with_tail(logk: jax.Array, tail: jax.Array | None = None) -> jax.Array:
    """[..., k] log-probs -> [..., k + 1]: the k and one bucket with the rest of the mass: `tail` [...] its
    log-mass when the caller has it from the logits outside the k (`core.kernels.logprobs.excluded_logsumexp`),
    else log(1 - sum_k), floored (exact only while the k hold less than ~1 - 1e-7 of the mass in float32)."""
    if tail is None:
        mass = jnp.sum(jnp.exp(logk), axis=-1, keepdims=True)
        tail = jnp.log(jnp.maximum(1.0 - mass, _TAIL_FLOOR))
    else:
        tail = tail.astype(jnp.float32)[..., None]
    return jnp.concatenate([logk, tail], axis=-1)


def topk_divergence(
    student_logq: jax.Array,
    teacher_logp: jax.Array,
    kind: Divergence,
    mode: TopKMode = "renormalised",
    beta: float = 0.5,
    student_tail: jax.Array | None = None,
    teacher_tail: jax.Array | None = None,
) -> jax.Array:
    """[..., k] log-probs of the teacher's top-k ids under each model (over the whole vocabulary, at the loss's
    temperature) -> [...] divergence on the top-k (module docstring). In tail mode, `student_tail` /
    `teacher_tail` [...] are each model's log-mass outside the k, taken from its logits there (the training
    objective passes the student's: once its top-k mass rounds to 1, 1 - sum_k would come from the floor and turn
    forward KL's gradient around); without them, 1 - sum_k."""
    logq, logp = student_logq.astype(jnp.float32), teacher_logp.astype(jnp.float32)
    if mode == "renormalised":
        logq = logq - jax.nn.logsumexp(logq, axis=-1, keepdims=True)
        logp = logp - jax.nn.logsumexp(logp, axis=-1, keepdims=True)
    elif mode == "tail":
        logq, logp = _with_tail(logq, student_tail), _with_tail(logp, teacher_tail)
    else:
        raise ValueError(f"unknown top-k mode {mode!r}")
    return divergence_of_logprobs(logq, logp, kind, beta)


def topk_mass(logk: jax.Array) -> jax.Array:
    """[..., k] log-probs -> [...] the mass a model puts on those k ids (logged for both models: a student that
    shrinks its own top-k mass shows here)."""
    return jnp.sum(jnp.exp(logk.astype(jnp.float32)), axis=-1)


def mix_hard_label(
    kd: jax.Array, nll: jax.Array, alpha: float, temperature: float = 1.0, temperature_scale: bool = True
) -> jax.Array:
    """(1 - alpha) * (T^2 if `temperature_scale`) * kd + alpha * nll, per token."""
    soft = kd * (temperature**2 if temperature_scale else 1.0)
    return (1.0 - alpha) * soft + alpha * nll


def reverse_kl_advantages(
    student_logp: jax.Array,
    teacher_logp: jax.Array,
    reward_advantages: jax.Array | None = None,
    reward_weight: float = 0.0,
) -> jax.Array:
    """[B, T] per-token advantages of on-policy distillation: -(log q(x_t) - log p(x_t)) on the sampled tokens, plus
    `reward_weight` times a task reward's advantages ([B] per sequence or [B, T]) when given."""
    adv = -(student_logp.astype(jnp.float32) - teacher_logp.astype(jnp.float32))
    if reward_advantages is not None and reward_weight:
        extra = reward_advantages.astype(jnp.float32)
        adv = adv + reward_weight * (extra[:, None] if extra.ndim == 1 else extra)
    return adv


def feature_loss(
    student_hidden: jax.Array,
    teacher_hidden: jax.Array,
    kind: FeatureKind = "cosine",
    projection: jax.Array | None = None,
) -> jax.Array:
    """[N, Ds] student and [N, Dt] teacher hidden states -> [N]: 1 - cosine similarity, or the mean squared
    difference per dimension, after the student's states go through `projection` ([Ds, Dt], learned with the
    student; needed when the widths differ)."""
    hs, ht = student_hidden.astype(jnp.float32), teacher_hidden.astype(jnp.float32)
    if projection is not None:
        hs = hs @ projection.astype(jnp.float32)
    if hs.shape[-1] != ht.shape[-1]:
        raise ValueError(
            f"feature loss: student width {hs.shape[-1]} != teacher width {ht.shape[-1]}: give a projection"
        )
    if kind == "cosine":
        # sqrt(|x|^2 + eps), not jnp.linalg.norm: its gradient at a zero vector (a padding position) is NaN, and a
        # NaN times a zero mask is still NaN.
        norm = jnp.sqrt(jnp.sum(hs * hs, axis=-1) + _NORM_FLOOR) * jnp.sqrt(jnp.sum(ht * ht, axis=-1) + _NORM_FLOOR)
        return 1.0 - jnp.sum(hs * ht, axis=-1) / norm
    if kind == "l2":
        return jnp.mean((hs - ht) ** 2, axis=-1)
    raise ValueError(f"unknown feature loss {kind!r}")


def scheduled(start: float, end: float, kind: Schedule, step: jax.Array | int, total: int) -> jax.Array:
    """A hyper-parameter (alpha, T, a feature weight) at `step` of `total`: `constant` start; `linear` from start to
    end; `cosine` from start to end along half a cosine (MaxText's `*_end` / `*_schedule`)."""
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(total, 1), 0.0, 1.0)
    if kind == "constant":
        return jnp.asarray(start, jnp.float32)
    if kind == "linear":
        return start + (end - start) * frac
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    raise ValueError(f"unknown schedule {kind!r}")
