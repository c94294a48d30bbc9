"""The trainer side of RL: the policy (and reference) on the trainer mesh, the optimizer, the jitted step.

    learner = PolicyLearner(cfg, model, mesh, total_steps=cfg.train.steps)
    metrics = learner.train(batch)        # a `posttrain.rl_batch` batch; one RL step
    learner.params, learner.version       # what weight sync sends, and its policy version

One RL step: `rl.num_iterations` passes over the batch, each cut into
`rl.mini_batches` optimizer updates (each accumulated over
`train.micro_batches`). The log-probs of the sampled tokens under the
reference, and under pi_old when there is more than one update, are computed
once up front; with one update the step's own forward pass is pi_old. Used in-process
(single-controller mode) or inside `posttrain.cluster.TrainerActor`.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from core.checkpoint import Checkpointer
from core.config import Config
from core.loop import NonFiniteLoss
from core.optim import make_optimizer, make_schedule
from core.train import (
    batch_sharding,
    batch_shards,
    init_train_state,
    jit_train_step,
    make_train_step,
    split_micro_batches,
)
from posttrain.losses import PolicyLossSettings
from posttrain.objective import make_policy_objective, target_logprobs


def loss_settings(cfg: Config) -> PolicyLossSettings:
    rl = cfg.rl
    return PolicyLossSettings(
        algorithm=rl.algorithm,
        epsilon=rl.epsilon,
        epsilon_high=rl.epsilon_high,
        dual_clip=rl.dual_clip,
        tis_cap=rl.tis_cap,
        beta=rl.beta,
        kl_estimator=rl.kl_estimator,
        loss_agg=rl.loss_agg,
        max_tokens=cfg.rollout.max_tokens,
    )


def summarise_updates(updates: list[dict[str, float]], passes: int) -> dict[str, float]:
    """One step's metrics from its updates' (each normalised by its own denominator `tokens`):
    loss / grad norm / learning rate averaged, token statistics as ratios of the summed raw sums,
    and the sampler mismatch over the first pass (pi_old's log-probs, every completion token once)."""
    total = lambda key, ms=updates: sum(m[key] * m["tokens"] for m in ms)
    out = {
        k: float(np.mean([m[k] for m in updates])) for k in ("loss", "grad_norm", "learning_rate") if k in updates[0]
    }
    tokens = max(total("completion_tokens"), 1e-9)
    out["clip_fraction"] = total("clipped_tokens") / tokens
    out["entropy"] = total("entropy") / tokens
    if "kl" in updates[0]:
        out["kl"] = total("kl") / max(total("kl_tokens"), 1e-9)
    if "tis_weight" in updates[0]:
        out["tis_weight_mean"] = total("tis_weight") / tokens
    if "mismatch_gap" in updates[0]:
        first = updates[: len(updates) // passes]
        out["mismatch/logp_gap_mean"] = total("mismatch_gap", first) / max(total("mismatch_tokens", first), 1e-9)
        out["mismatch/logp_gap_max"] = max(max(m["max/mismatch_gap"] for m in first), 0.0)
        out["mismatch/seq_kl"] = total("mismatch_seq_kl", first) / max(total("mismatch_sequences", first), 1e-9)
    return out


def mini_batch(x: np.ndarray, m: int, mini_batches: int) -> np.ndarray:
    """Mini-batch m of an array's first axis (rows and completions alike: `rl_batch` packs per group)."""
    n = x.shape[0] // mini_batches
    return x[m * n : (m + 1) * n]


class PolicyLearner:
    def __init__(
        self, cfg: Config, model, mesh: Mesh, total_steps: int, tx: optax.GradientTransformation | None = None
    ):
        """`tx` replaces the optimizer `cfg.optim` describes (e.g. one that records gradients, in tests)."""
        self.cfg = cfg
        self.mesh = mesh
        self.model_cfg = model.cfg
        updates = total_steps * cfg.rl.num_iterations * cfg.rl.mini_batches
        with jax.set_mesh(mesh):
            tx = tx or make_optimizer(cfg.optim, updates, nnx.state(model))
            # The reference is the starting policy, frozen: a copy of its parameters (beta = 0: none at all).
            self.ref_params = jax.tree.map(jnp.copy, nnx.state(model)) if cfg.rl.beta > 0 else None
            self.graphdef, self.state = init_train_state(model, tx, cfg.run.seed)
        objective = make_policy_objective(loss_settings(cfg), cfg.rollout.temperature or 1.0)
        self._step = jit_train_step(
            make_train_step(self.graphdef, objective, tx, make_schedule(cfg.optim, updates)), self.state
        )
        temperature = cfg.rollout.temperature or 1.0
        self._logp = jax.jit(lambda p, b: target_logprobs(nnx.merge(self.graphdef, p), b, temperature)[0])
        self.version = 0
        self.skipped_updates = 0  # non-finite loss or gradient (train.nan_policy=skip)
        self.empty_updates = 0  # mini-batches with no loss token: no optimizer step

    @property
    def params(self) -> nnx.State:
        return self.state.params

    def batch_shards(self) -> int:
        """The trainer's data-parallel size: packed row counts are made a multiple of it."""
        return batch_shards(self.mesh)

    # ------------------------------------------------------------------ train

    def place_inputs(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The model inputs and `target_index` as the batch's packing groups (one per mini-batch x micro-batch)
        on the trainer mesh (for `logprobs`)."""
        keys = ("tokens", "positions", "segment_ids", "branch_ids", "target_index", "target_ids")
        groups = self.cfg.rl.mini_batches * self.cfg.train.micro_batches
        chunks = split_micro_batches({key: batch[key] for key in keys}, groups)
        return {key: jax.device_put(v, batch_sharding(self.mesh, v.shape)) for key, v in chunks.items()}

    def logprobs(self, params: nnx.State, inputs: dict[str, jax.Array]) -> np.ndarray:
        """[B, C] log-probs of every completion token under `params`, one micro-batch at a time."""
        out = []
        with jax.set_mesh(self.mesh):
            for i in range(inputs["tokens"].shape[0]):
                part = {key: v[i] for key, v in inputs.items()}
                out.append(np.asarray(jax.device_get(self._logp(params, part))))
        return np.concatenate(out).astype(np.float32)

    def train(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One RL step on a rollout batch; returns its metrics (means over the updates)."""
        batch = dict(batch)
        rl = self.cfg.rl
        # One update per batch starts at pi_old, so the step's own forward pass gives pi_old's log-probs
        # (objective: stop_gradient(logp)); more updates need them fixed up front, one extra pass.
        several_updates = rl.num_iterations * rl.mini_batches > 1
        if several_updates or self.ref_params is not None:
            inputs = self.place_inputs(batch)
            targets = batch["completion_mask"] > 0
            if several_updates:
                batch["old_logp"] = self.logprobs(self.state.params, inputs) * targets
            if self.ref_params is not None:
                batch["ref_logp"] = self.logprobs(self.ref_params, inputs) * targets
        collected: list[dict] = []
        start = time.perf_counter()
        updates = rl.num_iterations * rl.mini_batches
        with jax.set_mesh(self.mesh):
            for u in range(updates):
                m = u % rl.mini_batches
                mini = {k: mini_batch(v, m, rl.mini_batches) for k, v in batch.items()}
                micro = split_micro_batches(mini, self.cfg.train.micro_batches)
                micro = {k: jax.device_put(v, batch_sharding(self.mesh, v.shape)) for k, v in micro.items()}
                self.state, metrics = self._step(self.state, micro)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                if not metrics["finite"]:
                    # The step left parameters and optimizer state as they were (core.train).
                    if self.cfg.train.nan_policy == "abort":
                        raise NonFiniteLoss(
                            f"RL step {self.version + 1}, update {u + 1} of {updates}: loss {metrics['loss']}, "
                            f"grad norm {metrics['grad_norm']} is not finite; that update was not applied"
                        )
                    self.skipped_updates += 1
                self.empty_updates += int(metrics["empty"])
                collected.append(metrics)
        self.version += 1
        return {
            **summarise_updates(collected, rl.num_iterations),
            "skipped_updates": float(self.skipped_updates),
            "empty_updates": float(self.empty_updates),
            "time/update_s": time.perf_counter() - start,
        }

    # ------------------------------------------------------------ checkpoints

    def save(self, checkpointer: Checkpointer, step: int, extra: dict) -> None:
        checkpointer.save(self.state, None, self.cfg, {**extra, "policy_version": self.version}, step=step)

    def restore_latest(self, checkpointer: Checkpointer) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (a corrupt one is moved aside), or None."""
        with jax.set_mesh(self.mesh):
            restored = checkpointer.restore_latest(self.state, None, self.cfg)
        if restored is None:
            return None
        self.state, meta, step = restored
        self.version = int(meta["policy_version"])
        return step, meta

    def export_hf(self, path: str | Path, tokenizer_dir: str | None) -> Path:
        from core.hf import save_hf

        return save_hf(nnx.merge(self.graphdef, self.state.params), self.model_cfg, path, tokenizer_dir=tokenizer_dir)
