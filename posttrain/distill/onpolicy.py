"""On-policy distillation: the student samples, the teacher scores every sampled token, the student learns from
the per-token reverse KL with the policy-gradient update (a method of `posttrain.onpolicy.run.OnPolicyRun`).

    summary = run_onpolicy_distill(cfg)     # python -m recipes.distill CONFIG.yml distill.regime=on_policy

Each step samples `rl.batch.prompts_per_step` prompts x `rl.batch.num_generations` completions (one is enough)
from the current student with the rollout machinery GRPO uses (vLLM samplers on Ray, or the JAX sampler;
weight sync after every update; `rl.off_policy_steps` for async sampling with bounded staleness). In the trainer,
the teacher (`distill.teacher`, any checkpoint with the same tokenizer, frozen, at the sampler's temperature)
scores every sampled token, and token t's advantage is

    A_t = -(log q(x_t) - log p(x_t))  [+ distill.reward_weight * the completion's group advantage]

with log q the sampler's log-prob of the token it drew and log p the teacher's: the per-token reverse KL on the
sampled token (`posttrain.losses.distill.reverse_kl_advantages`; Agarwal et al.'s on-policy GKD with beta = 1,
the recipe of Qwen3 and of Thinking Machines' on-policy distillation). The update is the clipped
policy-gradient objective of `posttrain.onpolicy.policy_gradient` (importance ratio against the sampler, TIS,
`rl.loss.*`), so everything GRPO has (micro-batches, several updates a batch, checkpoints and exact resume) holds.
With reward functions and `distill.reward_weight` > 0 a task reward's group advantage (`rl.advantage.*`; it
needs `rl.batch.num_generations` >= 2) is added to every token of its completion.

Metrics: `reverse_kl` (mean over sampled tokens of log q - log p: an estimate of KL(student || teacher) on the
student's own samples), `teacher_logp` (the teacher's mean log-prob of the student's tokens), and GRPO's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from core.config_loader import ConfigError
from posttrain.advantages import group_advantages
from posttrain.config import PostTrainConfig
from posttrain.distill.teacher import check_teacher_vocab, teacher_tokenizer_matches
from posttrain.frozen import FrozenModel
from posttrain.losses.distill import reverse_kl_advantages
from posttrain.onpolicy.learner import TrainStats
from posttrain.onpolicy.policy_gradient import PolicyGradientLearner, RLBatch, build_rl_batch
from posttrain.onpolicy.run import OnPolicyRun, RunSummary, Scored, StepData, run_to_end


def check_config(cfg: PostTrainConfig) -> None:
    d = cfg.distill
    if d.teacher is None:
        raise ConfigError("on-policy distillation needs distill.teacher (an HF directory, a Hub id or a Temper run)")
    from core.hub import resolve_model

    resolve_model(d.teacher, "distill.teacher")  # a missing path fails here, not in the trainer
    from core.data import load_tokenizer
    from posttrain.onpolicy.run import run_tokenizer

    mismatch = teacher_tokenizer_matches(d.teacher, load_tokenizer(run_tokenizer(cfg)))
    if mismatch:
        raise ConfigError(f"the teacher's tokenizer is not the student's: {mismatch}")
    if d.reward_weight > 0:
        if not cfg.reward.functions:
            raise ConfigError(f"distill.reward_weight={d.reward_weight} needs reward.functions to score with")
        if cfg.rl.batch.num_generations < 2:
            raise ConfigError(
                f"distill.reward_weight={d.reward_weight}: a reward's advantage compares each completion with the "
                f"rest of its prompt's, so rl.batch.num_generations must be >= 2, not {cfg.rl.batch.num_generations}"
            )
    updates = cfg.rl.batch.mini_batches * cfg.train.micro_batches
    if (cfg.rl.batch.prompts_per_step * cfg.rl.batch.num_generations) % updates:
        raise ConfigError(
            f"rl.batch.prompts_per_step * rl.batch.num_generations must be divisible by rl.batch.mini_batches * "
            f"train.micro_batches ({updates})"
        )


class OnPolicyDistillLearner(PolicyGradientLearner):
    """The policy-gradient learner with a teacher beside it: the reverse-KL advantages are made here, where the
    teacher is."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        model,
        mesh: Mesh,
        total_steps: int,
        tx: optax.GradientTransformation | None = None,
    ):
        super().__init__(cfg, model, mesh, total_steps, tx)
        path = str(cfg.distill.teacher)
        self.teacher = FrozenModel.load(path, mesh, "teacher", self.temperature, cfg.distill.teacher_dtype)
        assert self.teacher.cfg is not None
        check_teacher_vocab(self.teacher.cfg.vocab_size, self.learner.model_cfg.vocab_size, path, "the student's")

    def train(self, batch: RLBatch) -> TrainStats:
        rl = self.cfg.rl.batch
        mask = np.asarray(batch.packed.target_mask) > 0
        teacher = self.teacher.logprobs(batch.packed, rl.mini_batches * self.cfg.train.micro_batches)
        sampler = np.asarray(batch.sampler_logp, np.float32)
        kl_adv = np.asarray(reverse_kl_advantages(jnp.asarray(sampler), jnp.asarray(teacher))) * mask
        stats = super().train(batch.replace(advantages=np.asarray(batch.advantages, np.float32) + kl_adv))
        n = max(int(mask.sum()), 1)
        reverse_kl = float(-(kl_adv[mask]).sum() / n)
        metrics = {**stats.metrics, "reverse_kl": reverse_kl, "teacher_logp": float(teacher[mask].sum() / n)}
        return TrainStats(metrics, f"rkl {reverse_kl:.4f} | {stats.line}")


class OnPolicyDistillRun(OnPolicyRun):
    """Completions of the student, one advantage per token (made in the trainer), an `RLBatch`."""

    learner_class = OnPolicyDistillLearner

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def _prepare(self, scored: Scored) -> StepData:
        completions, d = scored.completions, self.cfg.distill
        reward = np.zeros(len(completions), np.float32)
        metrics: dict[str, float] = {}
        if scored.rewards is not None and d.reward_weight > 0:
            rl = self.cfg.rl
            adv = group_advantages(
                scored.rewards.total, rl.batch.num_generations, rl.advantage.estimator, rl.advantage.std_eps
            )
            reward = d.reward_weight * np.asarray(adv.values, np.float32)
            metrics["zero_variance_groups"] = float(adv.zero_variance_groups)
        # The reward part per token; the trainer adds the teacher's.
        advantages = [np.full(len(c.token_ids), reward[i], np.float32) for i, c in enumerate(completions)]
        batch = build_rl_batch(
            completions,
            advantages,
            np.ones(len(completions), bool),
            row_len=self.row_len,
            max_tokens=self.cfg.rollout.max_tokens,
            groups=self.cfg.rl.batch.mini_batches * self.cfg.train.micro_batches,
            row_multiple=self.row_multiple,
            share_prompts=self.cfg.rl.batch.share_prompts,
            choose_rows=self.row_counts.pick,
        )
        return StepData(batch, scored, metrics)


def run_onpolicy_distill(cfg: PostTrainConfig) -> RunSummary:
    return run_to_end(OnPolicyDistillRun(cfg))
