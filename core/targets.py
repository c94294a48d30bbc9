"""Log-probs of a packed batch's targets under a model: the output head every post-training method shares.

    logp, entropy = target_logprobs(model, batch, temperature=1.0)    # [B, C] each
    logp, _ = target_logprobs(model, batch, entropy=False)             # losses that do not read the entropy
    states = target_states(model, batch)          # hidden states at the targets, flat, with the output weight

Only the positions that predict a real target go through the output
projection (`core.kernels.logprobs`: logits kept for the backward pass within
`model.logits_budget_mb`, vocabulary-tiled above it), so prompt and padding
positions never pay for a vocabulary-sized matmul: the `batch.scored` real
targets of the micro-batch are scored as one flat list and scattered back
into `[B, C]`, whose empty slots (a shorter completion's tail) read 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from core.batch import PackedBatch
from core.kernels.logprobs import Layout, logprobs_and_entropy


@dataclass(frozen=True)
class TargetStates:
    """A model's final hidden states at the positions that predict a packed batch's real targets, as one flat
    list, with its output weight: what every head over the targets (log-probs, another model's top-k, a divergence
    between two models) reads."""

    hidden: jax.Array  # [F, D]: F = batch.scored real targets (padded with position 0), or every [B, C] slot
    ids: jax.Array  # [F] the target tokens
    weight: jax.Array  # the output projection, in the hidden states' dtype
    layout: Layout
    real: jax.Array | None  # [F] each entry's slot in the flat [B * C] (out of range on padding); None: all slots
    shape: tuple[int, int]  # [B, C]
    features: jax.Array | None = None  # [F, n, D]: the residual stream after each requested layer, at the same F

    def to_slots(self, x: jax.Array) -> jax.Array:
        """[F, ...] per-entry values -> [B, C, ...], 0 where there is no real target."""
        b, c = self.shape
        if self.real is not None:
            x = jnp.zeros((b * c, *x.shape[1:]), x.dtype).at[self.real].set(x, mode="drop")
        return x.reshape(b, c, *x.shape[1:])

    def over_vocab(self, vocab: int | None) -> TargetStates:
        """These states with the output weight cut to its first `vocab` tokens (a larger model's padded embedding read
        over a smaller model's vocabulary); None: as they are."""
        if vocab is None:
            return self
        weight = self.weight[:, :vocab] if self.layout == "dv" else self.weight[:vocab]
        return dataclasses.replace(self, weight=weight)

    def from_slots(self, x: jax.Array) -> jax.Array:
        """[B, C, ...] per-slot values (another model's stored top-k) -> [F, ...] in this list's order."""
        b, c = self.shape
        flat = x.reshape(b * c, *x.shape[2:])
        return flat if self.real is None else jnp.take(flat, self.real, axis=0, mode="fill", fill_value=0)


def target_states(
    model, batch: PackedBatch, layers: Sequence[int] = (), rng: jax.Array | None = None, routed: bool = False
) -> TargetStates:
    """`model`'s hidden states at the positions predicting `batch`'s targets. Only the `batch.scored` real
    targets are listed (when that is fewer than the slots): prompt and padding positions never reach a
    vocabulary-sized matmul. With `layers` (decoder layer numbers, `Decoder.layer_states`), `features` holds
    the residual stream after each of them at the same positions (a feature-distillation loss's input). `rng`: the
    training pass's key (LoRA's dropout; None: no dropout, as in scoring). `routed`: `model` is the model whose
    sampler routed the batch (the sampled model's own passes), so its mixture-of-experts layers read the batch's
    routes (`PackedBatch.routes`, replayed with `PackedBatch.replay`); any other model (frozen, or another trained
    part of the module tree) routes as its own routers do, whatever the batch carries."""
    hidden, per_layer = model.layer_states(  # [R, L, D], n x [R, L, D]
        batch.tokens,
        batch.positions,
        batch.segment_ids,
        batch.branch_ids,
        compact=batch.compact,
        layers=layers,
        rng=rng,
        routes=batch.routes if routed else None,
        replay=batch.replay and routed,
    )
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [R * L, D]
    weight, layout = model.output_weight()
    b, c = batch.target_index.shape
    slots = b * c
    index, ids = batch.target_index.reshape(-1), batch.target_ids.reshape(-1)
    real = None
    if 0 < batch.scored < slots:
        # The slots of the real targets, in order; `fill` pads the list with an out-of-range slot, whose
        # gathers read 0 and whose scatters are dropped.
        (real,) = jnp.nonzero(batch.target_mask.reshape(-1) > 0, size=batch.scored, fill_value=slots)
        index = jnp.take(index, real, mode="fill", fill_value=0)
        ids = jnp.take(ids, real, mode="fill", fill_value=0)
    features = None
    if per_layer:
        features = jnp.stack([h.reshape(-1, h.shape[-1])[index] for h in per_layer], axis=1)  # [F, n, D]
    return TargetStates(hidden[index], ids, weight.astype(hidden.dtype), layout, real, (b, c), features)


def target_logprobs(
    model,
    batch: PackedBatch,
    temperature: float = 1.0,
    entropy: bool = True,
    rng: jax.Array | None = None,
    routed: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """([B, C] log p(target j | everything before it), [B, C] entropy of that distribution or None when
    `entropy` is False) under `model`, with logits divided by `temperature` (a sampler's temperature, so that
    its log-probs and these agree). `rng`: the training pass's key (LoRA's dropout). `routed`: `model` is the one
    whose sampler routed the batch (`target_states`)."""
    states = target_states(model, batch, rng=rng, routed=routed)
    logp, ent = states_logprobs(model.cfg, states, temperature, entropy)
    return states.to_slots(logp), None if ent is None else states.to_slots(ent)


def states_logprobs(
    model_cfg, states: TargetStates, temperature: float = 1.0, entropy: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """([F] log-probs of the targets, [F] entropies or None) from a model's `TargetStates`, vocabulary-tiled
    above `model_cfg.logits_budget_mb` (`core.kernels.logprobs`)."""
    logp, ent = logprobs_and_entropy(
        states.hidden[None],  # [1, F, D]
        states.weight,
        states.ids[None],
        temperature=temperature,
        chunk_size=model_cfg.vocab_chunk_size,
        layout=states.layout,
        entropy=entropy,
        logits_budget_bytes=int(model_cfg.logits_budget_mb * 2**20),
    )
    return logp[0], None if ent is None else ent[0]
