"""GRPO / GSPO (and the DAPO, Dr.GRPO and RLOO variants) as a method of the on-policy run.

    summary = fit(cfg, GRPO)         # python -m recipes.grpo CONFIG.yml [key=value ...]

What is GRPO's own: each prompt's `rl.batch.num_generations` completions form a group, scored by the reward
functions; their advantages (`posttrain.onpolicy.policy_gradient.step_advantages`: an estimator of
`posttrain.advantages` by name, group_norm, drgrpo, rloo, REINFORCE++, or GDPO's per-reward normalisation)
weight every token of their completion; DAPO's dynamic sampling (`rl.batch.dynamic_sampling`) drops groups
without reward variance and refills the batch. The batch is the policy-gradient `RLBatch` and the update the
clipped objective of `posttrain.onpolicy.policy_gradient.PolicyGradient` (GRPO's per-token ratio or GSPO's
sequence ratio, `rl.algorithm`), run by the trainer; the sampling, rewards, weight sync, evaluation and
checkpoints are the on-policy run's (`posttrain.onpolicy.run.build_sampler_run`). A group a reward function failed on
trains not at all (`reward/failed_groups`); a group whose rewards are all equal carries no policy signal
(`zero_variance_groups`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from core.config_loader import ConfigError
from posttrain.advantages import Advantages, group_advantages
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.checks import check_graded_groups
from posttrain.onpolicy.method import SampleContext
from posttrain.onpolicy.policy_gradient import (
    PolicyGradient,
    mini_batch,
    rl_batch,
    step_advantages,
    updates_per_step,
)
from posttrain.onpolicy.rl_batch import RLBatch
from posttrain.onpolicy.step import Scored, StepData
from rewards.runner import RewardBatch
from rollout.sampler import Completion


def check_config(cfg: PostTrainConfig) -> None:
    """What GRPO needs of several sections at once (before a Ray cluster or an engine starts)."""
    batch = cfg.rl.batch
    check_graded_groups(cfg, "GRPO's advantages compare each completion with the rest of its group: it")
    updates = batch.mini_batches * cfg.train.micro_batches
    completions = batch.prompts_per_step * batch.num_generations
    if completions % updates:
        raise ConfigError(
            f"rl.batch.prompts_per_step * rl.batch.num_generations ({batch.prompts_per_step} * "
            f"{batch.num_generations} = {completions}) must be divisible by rl.batch.mini_batches * "
            f"train.micro_batches ({batch.mini_batches} * {cfg.train.micro_batches} = {updates})"
        )


class GRPOMethod(PolicyGradient):
    """Group advantages of each prompt's completions and DAPO's dynamic sampling make an `RLBatch`, trained by the
    clipped policy-gradient update."""

    name = "GRPO"
    trains_segments = True

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def from_samples(self, cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
        assert scored.rewards is not None  # GRPO has reward functions (checked)
        adv = step_advantages(cfg, scored.rewards, scored.completions, earlier_segments(scored))
        rounds = 1
        if cfg.rl.batch.dynamic_sampling:
            scored, adv, rounds = refill(cfg, scored, adv, ctx.more)
        metrics = {
            "zero_variance_groups": float(adv.zero_variance_groups),
            "reward/failed_groups": float(adv.failed_groups),
            "sampling_rounds": float(rounds),
            **adv.normalized,
        }
        batch = rl_batch(cfg, scored.completions, adv, ctx.row_len, ctx.row_multiple, earlier=earlier_segments(scored))
        # the batch's sequences with a target: its completions, an agent's earlier segments each one (padding none)
        metrics["sequences"] = float(np.asarray(batch.packed.target_mask).any(axis=1).sum())
        return StepData(batch, scored, metrics)

    def example_batch(self, cfg: PostTrainConfig, row_multiple: int) -> RLBatch:
        """`train.compile_only`: the first mini-batch of an `RLBatch` built as `from_samples` builds it, of
        `rl.batch.prompts_per_step` prompts of `rollout.max_model_len - max_tokens` tokens, each with
        `num_generations` completions of `rollout.max_tokens`, advantages with variance, pi_old's and the
        reference's log-probs when the step reads them."""
        rl, rollout = cfg.rl.batch, cfg.rollout
        rng = np.random.default_rng(0)

        def tokens(n: int) -> list[int]:
            return [int(t) for t in rng.integers(1, cfg.model.vocab_size, size=n)]

        prompts = [tokens(rollout.max_model_len - rollout.max_tokens) for _ in range(rl.prompts_per_step)]
        completions = [
            Completion(p, tokens(rollout.max_tokens), [-1.0] * rollout.max_tokens, "stop", "")
            for p in prompts
            for _ in range(rl.num_generations)
        ]
        adv = group_advantages(rng.normal(size=len(completions)), rl.num_generations, cfg.rl.advantage.estimator)
        batch = rl_batch(cfg, completions, adv, self.row_length(cfg), row_multiple)
        zeros = np.zeros_like(batch.sampler_logp)
        several = updates_per_step(cfg) > 1
        batch = batch.replace(old_logp=zeros if several else None, ref_logp=zeros if cfg.rl.loss.beta else None)
        return mini_batch(batch, 0, rl.mini_batches)


GRPO = GRPOMethod()


def refill(
    cfg: PostTrainConfig, scored: Scored, adv: Advantages, more: Callable[[], Scored]
) -> tuple[Scored, Advantages, int]:
    """DAPO dynamic sampling: keep groups with reward variance, draw more prompts (`more`: another request,
    sampled and scored) until the batch is full. Groups are picked from the scored batches as they are (no second
    scoring)."""
    g, want = cfg.rl.batch.num_generations, cfg.rl.batch.prompts_per_step
    batches = [scored]  # every batch drawn this step
    first = adv.signal.reshape(-1, g)[:, 0]
    picks = [(0, i) for i in range(len(scored.rows)) if first[i]]  # (batch, group) in training order
    rounds = 1
    while len(picks) < want and rounds < cfg.rl.batch.max_sampling_rounds:
        extra = more()
        assert extra.rewards is not None
        batches.append(extra)
        ok = step_advantages(cfg, extra.rewards).signal.reshape(-1, g)[:, 0]
        picks += [(len(batches) - 1, i) for i in range(len(extra.rows)) if ok[i]][: want - len(picks)]
        rounds += 1
    if len(picks) < want:  # not enough signal even after refilling: train on what there is, padded
        picks += [(0, i) for i in range(len(scored.rows)) if not first[i]][: want - len(picks)]
    items = [(batches[b], np.arange(i * g, (i + 1) * g)) for b, i in picks]
    rewards = RewardBatch.concat([src.rewards.take(idx) for src, idx in items])  # type: ignore[union-attr]
    correct = None
    if scored.correct is not None:
        correct = np.concatenate([src.correct[idx] for src, idx in items])  # type: ignore[index]
    episodes = None
    if scored.episodes is not None:  # multi-turn rollouts: the picked groups' episodes
        episodes = [src.episodes[j] for src, idx in items for j in idx]  # type: ignore[index]
    kept = Scored(
        [batches[b].rows[i] for b, i in picks],
        [src.completions[j] for src, idx in items for j in idx],
        rewards,
        correct,
        episodes,
    )
    return kept, step_advantages(cfg, rewards, kept.completions, earlier_segments(kept)), rounds


def earlier_segments(scored: Scored) -> list[list[Completion]] | None:
    """Each episode's trajectories before its last (an agent that rewrote its history), None for single turns."""
    return None if scored.episodes is None else [e.earlier for e in scored.episodes]
