"""Log-probs of a packed batch's targets under a model: the output head every post-training method shares.

    logp, entropy = target_logprobs(model, batch, temperature=1.0)    # [B, C] each
    logp, _ = target_logprobs(model, batch, entropy=False)             # losses that do not read the entropy

Only the positions that predict a target go through the output projection
(`core.kernels.logprobs`: logits kept for the backward pass within
`model.logits_budget_mb`, vocabulary-tiled above it), so prompt and padding
positions never pay for a vocabulary-sized matmul.
"""

from __future__ import annotations

import jax

from core.batch import PackedBatch
from core.kernels.logprobs import logprobs_and_entropy


def target_logprobs(
    model, batch: PackedBatch, temperature: float = 1.0, entropy: bool = True
) -> tuple[jax.Array, jax.Array | None]:
    """([B, C] log p(target j | everything before it), [B, C] entropy of that distribution or None when
    `entropy` is False) under `model`, with logits divided by `temperature` (a sampler's temperature, so that
    its log-probs and these agree)."""
    hidden = model.hidden_states(batch.tokens, batch.positions, batch.segment_ids, batch.branch_ids)  # [R, L, D]
    picked = hidden.reshape(-1, hidden.shape[-1])[batch.target_index]  # [B, C, D]
    weight, layout = model.output_weight()
    return logprobs_and_entropy(
        picked,
        weight.astype(hidden.dtype),
        batch.target_ids,
        temperature=temperature,
        chunk_size=model.cfg.vocab_chunk_size,
        layout=layout,
        entropy=entropy,
        logits_budget_bytes=int(model.cfg.logits_budget_mb * 2**20),
    )
