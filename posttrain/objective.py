"""The GRPO/GSPO objective on a core model, in the `core.train` loss contract.

An RL batch is prompt + completion rows, right-padded to one length L:

    tokens        [B, L] int32    prompt then completion, then padding
    positions     [B, L] int32
    segment_ids   [B, L] int32    1 on real tokens, 0 on padding
    loss_mask     [B, L-1] f32    1 where target token t+1 is a completion token that counts
    advantages    [B] f32
    old_logp      [B, L-1] f32    pi_old of each target (0 where loss_mask is 0)
    sampler_logp  [B, L-1] f32    what the sampler reported
    ref_logp      [B, L-1] f32    only when beta > 0

Log-probs are taken at the sampling temperature, as the sampler drew them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.kernels.logprobs import chunked_logprobs_and_entropy
from posttrain.losses import PolicyLossSettings, policy_loss


def target_logprobs(model, batch: dict, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """([B, L-1] log p(token t+1 | tokens <= t), [B, L-1] entropy) under `model` at `temperature`."""
    tokens = batch["tokens"]
    hidden = model.hidden_states(tokens, batch["positions"], batch["segment_ids"])  # [B, L, D]
    weight, layout = model.output_weight()
    return chunked_logprobs_and_entropy(
        hidden[:, :-1], weight.astype(hidden.dtype), tokens[:, 1:], temperature=temperature,
        chunk_size=model.cfg.vocab_chunk_size, layout=layout,
    )


def make_policy_objective(settings: PolicyLossSettings, temperature: float = 1.0):
    """loss_fn(model, batch, rng) -> (loss_sum, sums) for `core.train.make_train_step`."""

    def loss_fn(model, batch: dict, rng: jax.Array):
        del rng
        logp, entropy = target_logprobs(model, batch, temperature)
        mask = batch["loss_mask"].astype(jnp.float32)
        loss_sum, sums = policy_loss(
            logp, batch["old_logp"], batch["advantages"], mask, settings,
            sampler_logp=batch.get("sampler_logp"), ref_logp=batch.get("ref_logp"),
        )
        sums["entropy"] = (jax.lax.stop_gradient(entropy) * mask).sum()
        return loss_sum, sums

    return loss_fn
