"""The DPO family's objective: a loss over a `PairBatch`, the reference's log-probs beside it, and its metrics.

    loss_fn = preference_objective(cfg.dpo)                    # the core.train contract, for a core.learner.Learner
    batch = with_reference(batch, reference)                    # + [P] summed reference log-probs (a FrozenModel)
    learner.update(batch, micro_batches=2)

The policy's log-probs of both completions come from one pass over the
shared-prompt layout (`posttrain.dpo.pairs`), summed per completion, and go to
`posttrain.losses.preference.dpo_loss` with the reference's (live from a
`posttrain.frozen.FrozenModel`; the reference-free `simpo` and `orpo` have
none). The loss is the mean over the real pairs of the global batch: sums
over each micro-batch's pairs, divided once by the global pair count, so
micro-batching leaves the gradient unchanged. Metrics, means over pairs:
rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies (share
of pairs whose chosen reward is higher), logps/chosen, logps/rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.learner import Learner
from core.method import Attach, unchanged
from core.sums import summed
from core.targets import target_logprobs
from core.train import LossOutput
from posttrain.config import DPOConfig
from posttrain.dpo.pairs import PairBatch
from posttrain.frozen import FrozenModel
from posttrain.losses.preference import REFERENCE_FREE, dpo_loss


def needs_reference(cfg: DPOConfig) -> bool:
    return cfg.loss_type not in REFERENCE_FREE


def sequence_logps(logp: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([B] summed log-probs, [B] token counts) of each scored sequence."""
    mask = mask.astype(jnp.float32)
    return (logp * mask).sum(axis=-1), mask.sum(axis=-1)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PreferenceSums:
    """What the preference objective sums over a micro-batch's pairs (means per pair in the logs)."""

    chosen: Any = summed("rewards/chosen")
    rejected: Any = summed("rewards/rejected")
    margins: Any = summed("rewards/margins")
    accuracies: Any = summed("rewards/accuracies")  # pairs whose chosen completion gets the higher implicit reward
    logps_chosen: Any = summed("logps/chosen")
    logps_rejected: Any = summed("logps/rejected")


def preference_objective(cfg: DPOConfig):
    """loss_fn(model, PairBatch, rng) -> LossOutput (the sum of per-pair losses over the pairs) for
    `core.train.make_train_step`."""
    reference = needs_reference(cfg)

    def loss_fn(model, batch: PairBatch, rng: jax.Array | None) -> LossOutput:
        logp, _ = target_logprobs(model, batch.packed, entropy=False, rng=rng)
        seq, n = sequence_logps(logp, batch.packed.target_mask)
        pc, pr, nc, nr = seq[0::2], seq[1::2], n[0::2], n[1::2]
        if reference and (batch.ref_chosen is None or batch.ref_rejected is None):
            raise ValueError(f"dpo.loss_type={cfg.loss_type!r} needs the batch's reference log-probs")
        out = dpo_loss(
            pc,
            pr,
            batch.ref_chosen if reference else None,
            batch.ref_rejected if reference else None,
            loss_type=cfg.loss_type,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            gamma=cfg.simpo_gamma,
            rpo_alpha=cfg.rpo_alpha,
            chosen_tokens=nc,
            rejected_tokens=nr,
        )
        m = batch.pair_mask.astype(jnp.float32)
        chosen, rejected = jax.lax.stop_gradient(out.chosen_rewards), jax.lax.stop_gradient(out.rejected_rewards)
        sums = PreferenceSums(
            chosen=(chosen * m).sum(),
            rejected=(rejected * m).sum(),
            margins=((chosen - rejected) * m).sum(),
            accuracies=((chosen > rejected) * m).sum(),
            logps_chosen=(jax.lax.stop_gradient(pc) * m).sum(),
            logps_rejected=(jax.lax.stop_gradient(pr) * m).sum(),
        )
        return LossOutput((out.losses * m).sum(), m.sum(), sums)

    return loss_fn


def with_reference(batch: PairBatch, reference: FrozenModel) -> PairBatch:
    """`batch` with the reference's summed log-probs of every chosen and rejected completion."""
    logp = reference.logprobs(batch.packed)  # [2P, C], 0 where there is no target
    seq = logp.sum(axis=-1).astype(np.float32)
    return batch.replace(ref_chosen=seq[0::2], ref_rejected=seq[1::2])


@dataclass
class ReferenceValues:
    """The live reference's sequence log-probs of both sides of every pair, attached to a pair batch (what
    `core.method.Method.attach` returns for the DPO family, offline and online)."""

    reference: FrozenModel

    def __call__(self, batch: PairBatch) -> tuple[PairBatch, dict[str, float]]:
        return with_reference(batch, self.reference), {}


def live_reference(cfg: DPOConfig, learner: Learner) -> Attach[PairBatch]:
    """What attaches the reference's log-probs to a batch: the frozen starting policy's (`FrozenModel.start_of`),
    or nothing for a reference-free loss."""
    return ReferenceValues(FrozenModel.start_of(learner)) if needs_reference(cfg) else unchanged
