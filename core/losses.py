"""The next-token loss on a packed batch's targets: pretraining (every token) and SFT (assistant tokens) alike.

    out = nll_loss(model, batch, rng)                # the core.train contract: LossOutput(total, denominator)
    perplexity({"loss": 2.3})                        # what an evaluation derives from the mean loss

The sum runs over every target of the micro-batch and the denominator is
their count, so the train step divides once by the targets of the whole global
batch: micro-batching and packing leave the gradient unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from core.batch import PackedBatch
from core.targets import target_logprobs
from core.train import LossOutput


def nll_loss(model, batch: PackedBatch, rng: jax.Array | None) -> LossOutput:
    """The sum of -log p over the targets, over their number."""
    logp, _ = target_logprobs(model, batch, entropy=False, rng=rng)
    mask = batch.target_mask.astype(jnp.float32)
    return LossOutput(-(logp * mask).sum(), mask.sum())


def perplexity(means: dict[str, float]) -> dict[str, float]:
    """exp(mean NLL per target) from a held-out evaluation's means (capped: exp(50) already says "diverged")."""
    return {"perplexity": math.exp(min(means["loss"], 50.0))}
