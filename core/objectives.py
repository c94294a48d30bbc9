"""The next-token objective shared by pretraining and SFT, in the `core.train` loss contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.kernels.logprobs import chunked_logprobs_and_entropy


def target_mask(batch: dict) -> jax.Array:
    """[B, T-1] bool: token t+1 is a target given tokens <= t (same document, not padding, in loss_mask)."""
    seg = batch["segment_ids"]
    same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return same_doc & (batch["loss_mask"][:, 1:] > 0)


def next_token_loss(model, batch: dict, rng: jax.Array):
    """Summed next-token negative log-likelihood over target tokens, with vocabulary-tiled log-probs.

    Returns `(nll_sum, {"loss_denominator": n_targets})`; the train step divides
    by the global number of target tokens.
    """
    del rng  # deterministic objective
    tokens = batch["tokens"]
    hidden = model.hidden_states(tokens, batch["positions"], batch["segment_ids"])  # [B, T, D]
    weight, layout = model.output_weight()
    logp, _ = chunked_logprobs_and_entropy(
        hidden[:, :-1],
        weight.astype(hidden.dtype),
        tokens[:, 1:],
        chunk_size=model.cfg.vocab_chunk_size,
        layout=layout,
    )  # [B, T-1]
    mask = target_mask(batch).astype(jnp.float32)
    return -(logp * mask).sum(), {"loss_denominator": mask.sum()}
