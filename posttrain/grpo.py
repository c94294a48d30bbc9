"""GRPO / GSPO as a method on the shared skeleton: its loss on an `RLBatch`, its update schedule, its metrics.

    learner = GRPOLearner(cfg, model, mesh, total_steps=cfg.train.steps)
    metrics = learner.train(rl_batch)          # one RL step: the reference / pi_old passes, then the updates
    learner.params, learner.version            # what weight sync sends, and its policy version

One RL step is `rl.batch.num_iterations` passes over the batch, each cut into
`rl.batch.mini_batches` optimizer updates (each accumulated over
`train.micro_batches`), on a `core.learner.Learner` whose loss is
`policy_objective`. The reference (`rl.loss.beta` > 0) is a
`posttrain.frozen.FrozenModel`, a frozen copy of the starting policy; pi_old's
log-probs come from the update's own forward pass when the step has one
update (held constant by a stop-gradient: no extra pass), else from one pass
up front. The sampler-driven loop around it is `posttrain.onpolicy.loop`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from core.config import Config
from core.learner import Learner
from core.targets import target_logprobs
from posttrain.frozen import FrozenModel, grouped_logprobs, logprob_pass
from posttrain.losses.policy import PolicyLossSettings, policy_loss
from posttrain.onpolicy.learner import PolicyLearner
from posttrain.rl_batch import RLBatch


def loss_settings(cfg: Config) -> PolicyLossSettings:
    loss = cfg.rl.loss
    return PolicyLossSettings(
        algorithm=cfg.rl.algorithm,
        epsilon=loss.epsilon,
        epsilon_high=loss.epsilon_high,
        dual_clip=loss.dual_clip,
        tis_cap=loss.tis_cap,
        beta=loss.beta,
        kl_estimator=loss.kl_estimator,
        loss_agg=loss.loss_agg,
        max_tokens=cfg.rollout.max_tokens,
    )


# ------------------------------------------------------------------ the loss


def mismatch_sums(trainer_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Sums for the sampler/trainer mismatch: |gap| over the completion tokens (and its max), and the
    k1 estimate of KL(sampler || trainer) summed per sequence (tokens were drawn by the sampler).
    `summarise_updates` turns them into mean / max gap and the per-sequence KL."""
    gap = jnp.abs(trainer_logp - sampler_logp) * mask
    rows = mask.sum(axis=-1) > 0
    return {
        "mismatch_gap": gap.sum(),
        "mismatch_tokens": mask.sum(),
        "max/mismatch_gap": gap.max(),
        "mismatch_seq_kl": ((sampler_logp - trainer_logp) * mask).sum(),
        "mismatch_sequences": rows.sum().astype(jnp.float32),
    }


def policy_objective(settings: PolicyLossSettings, temperature: float = 1.0):
    """loss_fn(model, RLBatch, rng) -> (loss_sum, sums) for `core.train.make_train_step`. Log-probs are taken at
    the sampling temperature, as the sampler drew them."""

    def loss_fn(model, batch: RLBatch, rng: jax.Array):
        del rng
        logp, entropy = target_logprobs(model, batch.packed, temperature)
        assert entropy is not None  # asked for (the default)
        mask = batch.loss_mask.astype(jnp.float32)
        # The first update of a batch is at pi_old: its log-probs are this pass's, held constant.
        old_logp = batch.old_logp if batch.old_logp is not None else jax.lax.stop_gradient(logp)
        loss_sum, sums = policy_loss(
            logp,
            old_logp,
            batch.advantages,
            mask,
            settings,
            sampler_logp=batch.sampler_logp,
            ref_logp=batch.ref_logp,
            kl_mask=batch.kl_mask,
        )
        sums["entropy"] = (jax.lax.stop_gradient(entropy) * mask).sum()
        sums.update(mismatch_sums(old_logp, batch.sampler_logp, batch.packed.target_mask.astype(jnp.float32)))
        return loss_sum, sums

    return loss_fn


# ------------------------------------------------------------------ metrics


def summarise_updates(updates: list[dict[str, float]], passes: int) -> dict[str, float]:
    """One step's metrics from its updates' (each normalised by its own denominator `tokens`):
    loss / grad norm / learning rate averaged, token statistics as ratios of the summed raw sums,
    and the sampler mismatch over the first pass (pi_old's log-probs, every completion token once)."""

    def total(key: str, ms: list[dict[str, float]] = updates) -> float:
        return sum(m[key] * m["tokens"] for m in ms)

    out: dict[str, float] = {
        k: float(np.mean([m[k] for m in updates])) for k in ("loss", "grad_norm", "learning_rate") if k in updates[0]
    }
    tokens = max(total("completion_tokens"), 1e-9)
    out["clip_fraction"] = total("clipped_tokens") / tokens
    out["entropy"] = total("entropy") / tokens
    if "kl" in updates[0]:
        out["kl"] = total("kl") / max(total("kl_tokens"), 1e-9)
    if "tis_weight" in updates[0]:
        out["tis_weight_mean"] = total("tis_weight") / tokens
    first = updates[: len(updates) // passes]
    out["mismatch/logp_gap_mean"] = total("mismatch_gap", first) / max(total("mismatch_tokens", first), 1e-9)
    out["mismatch/logp_gap_max"] = max(max(m["max/mismatch_gap"] for m in first), 0.0)
    out["mismatch/seq_kl"] = total("mismatch_seq_kl", first) / max(total("mismatch_sequences", first), 1e-9)
    return out


def mini_batch(batch: RLBatch, m: int, mini_batches: int) -> RLBatch:
    """Mini-batch m: every array's first axis cut in `mini_batches` (rows and completions alike: `rl_batch` packs
    per group)."""
    return jax.tree.map(lambda x: x[m * (x.shape[0] // mini_batches) : (m + 1) * (x.shape[0] // mini_batches)], batch)


# ------------------------------------------------------------------ the learner


class GRPOLearner(PolicyLearner):
    def __init__(
        self, cfg: Config, model, mesh: Mesh, total_steps: int, tx: optax.GradientTransformation | None = None
    ):
        """`tx` replaces the optimizer `cfg.optim` describes (e.g. one that records gradients, in tests)."""
        super().__init__(cfg, mesh)
        schedule = cfg.rl.batch
        self.updates_per_step = schedule.num_iterations * schedule.mini_batches
        self.temperature = cfg.rollout.temperature or 1.0
        self.learner = Learner(
            model,
            mesh,
            policy_objective(loss_settings(cfg), self.temperature),
            cfg.optim,
            total_updates=total_steps * self.updates_per_step,
            seed=cfg.run.seed,
            tx=tx,
        )
        # The reference is the starting policy, frozen (beta = 0: none at all).
        self.reference = (
            FrozenModel.copy_of(self.learner.graphdef, self.learner.params, mesh, "reference", self.temperature)
            if cfg.rl.loss.beta > 0
            else None
        )
        self._policy_logprobs = logprob_pass(self.learner.graphdef, self.temperature)

    def train(self, batch: RLBatch) -> dict[str, float]:
        """One RL step on a rollout batch; returns its metrics (means over the updates)."""
        rl, micro = self.cfg.rl.batch, self.cfg.train.micro_batches
        groups = rl.mini_batches * micro  # the batch's packing groups
        # One update per batch starts at pi_old, so the step's own forward pass gives pi_old's log-probs
        # (objective: stop_gradient(logp)); more updates need them fixed up front, one extra pass.
        targets = np.asarray(batch.packed.target_mask) > 0
        if self.updates_per_step > 1:
            old = grouped_logprobs(self._policy_logprobs, self.learner.params, batch.packed, groups, self.mesh)
            batch = batch.replace(old_logp=old * targets)
        if self.reference is not None:
            batch = batch.replace(ref_logp=self.reference.logprobs(batch.packed, groups))
        collected: list[dict] = []
        start = time.perf_counter()
        for u in range(self.updates_per_step):
            metrics = self.learner.update(mini_batch(batch, u % rl.mini_batches, rl.mini_batches), micro)
            self._applied(metrics, f"RL step {self.version + 1}, update {u + 1} of {self.updates_per_step}")
            collected.append(metrics)
        self.version += 1
        return {
            **summarise_updates(collected, rl.num_iterations),
            "skipped_updates": float(self.skipped_updates),
            "empty_updates": float(self.empty_updates),
            "time/update_s": time.perf_counter() - start,
        }
