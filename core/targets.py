"""Log-probs of a packed batch's targets under a model: the output head every post-training method shares.

    logp, entropy = target_logprobs(model, batch, temperature=1.0)    # [B, C] each
    logp, _ = target_logprobs(model, batch, entropy=False)             # losses that do not read the entropy

Only the positions that predict a real target go through the output
projection (`core.kernels.logprobs`: logits kept for the backward pass within
`model.logits_budget_mb`, vocabulary-tiled above it), so prompt and padding
positions never pay for a vocabulary-sized matmul: the `batch.scored` real
targets of the micro-batch are scored as one flat list and scattered back
into `[B, C]`, whose empty slots (a shorter completion's tail) read 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.batch import PackedBatch
from core.kernels.logprobs import logprobs_and_entropy


def target_logprobs(
    model, batch: PackedBatch, temperature: float = 1.0, entropy: bool = True
) -> tuple[jax.Array, jax.Array | None]:
    """([B, C] log p(target j | everything before it), [B, C] entropy of that distribution or None when
    `entropy` is False) under `model`, with logits divided by `temperature` (a sampler's temperature, so that
    its log-probs and these agree)."""
    hidden = model.hidden_states(  # [R, L, D]
        batch.tokens, batch.positions, batch.segment_ids, batch.branch_ids, compact=batch.compact
    )
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [R * L, D]
    weight, layout = model.output_weight()
    b, c = batch.target_index.shape
    slots = b * c
    index, ids = batch.target_index.reshape(-1), batch.target_ids.reshape(-1)
    flat = 0 < batch.scored < slots
    if flat:
        # The slots of the real targets, in order; `fill` pads the list with an out-of-range slot, whose
        # gathers read 0 and whose scatters are dropped.
        (real,) = jnp.nonzero(batch.target_mask.reshape(-1) > 0, size=batch.scored, fill_value=slots)
        index = jnp.take(index, real, mode="fill", fill_value=0)
        ids = jnp.take(ids, real, mode="fill", fill_value=0)
    logp, ent = logprobs_and_entropy(
        hidden[index][None],  # [1, F, D]
        weight.astype(hidden.dtype),
        ids[None],
        temperature=temperature,
        chunk_size=model.cfg.vocab_chunk_size,
        layout=layout,
        entropy=entropy,
        logits_budget_bytes=int(model.cfg.logits_budget_mb * 2**20),
    )

    def to_slots(x):  # [1, F] -> [B, C]
        if flat:
            x = jnp.zeros((slots,), x.dtype).at[real].set(x[0], mode="drop")
        return x.reshape(b, c)

    return to_slots(logp), None if ent is None else to_slots(ent)
