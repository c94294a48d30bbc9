"""The GRPO/GSPO objective on a core model, in the `core.train` loss contract.

An RL batch (`posttrain.rl_batch`) packs prompt + completion sequences into
rows; every per-token array is in a completion-major `[B, C]` layout:

    tokens, positions, segment_ids [R, L]   packed rows (segment 0 = padding)
    branch_ids      [R, L] int32   0 = prompt, k >= 1 = k-th completion sharing the segment's prompt
    target_index    [B, C] int32   flat index into [R * L] of the position predicting completion token j
    target_ids      [B, C] int32   completion token j
    loss_mask       [B, C] f32     1 where completion token j exists and its policy term counts
    kl_mask         [B, C] f32     1 where its KL term counts (beta > 0)
    advantages      [B] f32
    old_logp        [B, C] f32     pi_old of each token; absent when the step starts from pi_old
                                   (one update per batch): then pi_old = stop_gradient(logp), no extra pass
    sampler_logp    [B, C] f32     what the sampler reported
    completion_mask [B, C] f32     every completion token, counted in the loss or not (mismatch statistics)
    ref_logp        [B, C] f32     only when beta > 0

Only the completion positions' hidden states go through the output projection
(prompt and padding positions never pay for a vocabulary-sized matmul).
Log-probs are taken at the sampling temperature, as the sampler drew them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.kernels.logprobs import chunked_logprobs_and_entropy
from posttrain.losses import PolicyLossSettings, policy_loss


def target_logprobs(model, batch: dict, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """([B, C] log p(completion token j | everything before it), [B, C] entropy) under `model` at `temperature`."""
    hidden = model.hidden_states(
        batch["tokens"], batch["positions"], batch["segment_ids"], batch["branch_ids"]
    )  # [R, L, D]
    index = batch["target_index"]  # [B, C]; a shared prompt's last position predicts each completion's first token
    picked = hidden.reshape(-1, hidden.shape[-1])[index]  # [B, C, D]
    targets = batch["target_ids"]
    weight, layout = model.output_weight()
    return chunked_logprobs_and_entropy(
        picked,
        weight.astype(hidden.dtype),
        targets,
        temperature=temperature,
        chunk_size=model.cfg.vocab_chunk_size,
        layout=layout,
    )


def mismatch_sums(trainer_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Sums for the sampler/trainer mismatch: |gap| over the completion tokens (and its max), and the
    k1 estimate of KL(sampler || trainer) summed per sequence (tokens were drawn by the sampler).
    `posttrain.learner` turns them into mean / max gap and the per-sequence KL."""
    gap = jnp.abs(trainer_logp - sampler_logp) * mask
    rows = mask.sum(axis=-1) > 0
    return {
        "mismatch_gap": gap.sum(),
        "mismatch_tokens": mask.sum(),
        "max/mismatch_gap": gap.max(),
        "mismatch_seq_kl": ((sampler_logp - trainer_logp) * mask).sum(),
        "mismatch_sequences": rows.sum().astype(jnp.float32),
    }


def make_policy_objective(settings: PolicyLossSettings, temperature: float = 1.0):
    """loss_fn(model, batch, rng) -> (loss_sum, sums) for `core.train.make_train_step`."""

    def loss_fn(model, batch: dict, rng: jax.Array):
        del rng
        logp, entropy = target_logprobs(model, batch, temperature)
        mask = batch["loss_mask"].astype(jnp.float32)
        # The first update of a batch is at pi_old: its log-probs are this pass's, held constant.
        old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
        loss_sum, sums = policy_loss(
            logp,
            old_logp,
            batch["advantages"],
            mask,
            settings,
            sampler_logp=batch.get("sampler_logp"),
            ref_logp=batch.get("ref_logp"),
            kl_mask=batch.get("kl_mask"),
        )
        sums["entropy"] = (jax.lax.stop_gradient(entropy) * mask).sum()
        if "completion_mask" in batch and "sampler_logp" in batch:
            sums.update(mismatch_sums(old_logp, batch["sampler_logp"], batch["completion_mask"].astype(jnp.float32)))
        return loss_sum, sums

    return loss_fn
