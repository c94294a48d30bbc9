"""The on-policy skeleton carries a method GRPO is not: no reward functions, one sample per prompt, a value per token
(what on-policy distillation needs), trained with the policy-gradient update the skeleton has; it stops on SIGTERM
like every run (the step finished and checkpointed) and resumes."""

from __future__ import annotations

import json
import os
import signal
from typing import ClassVar

import numpy as np
import pytest

from core.config_loader import load_config
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.method import SampleContext
from posttrain.onpolicy.policy_gradient import PolicyGradient
from posttrain.onpolicy.rl_batch import build_rl_batch
from posttrain.onpolicy.run import build_sampler_run
from posttrain.onpolicy.step import Scored, StepData


class PerToken(PolicyGradient):
    """A method of its own: every sampled token's advantage is minus its sampled log-prob (a stand-in for a
    teacher's per-token signal), no reward functions, one completion a prompt."""

    batches: ClassVar[list] = []
    terminate_at: ClassVar[int] = 0

    def from_samples(self, cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
        assert scored.rewards is None and scored.correct is None  # nothing was scored: there is nothing to score with
        advantages = [-np.asarray(c.logprobs, np.float32) for c in scored.completions]
        batch = build_rl_batch(
            scored.completions,
            advantages,
            np.ones(len(scored.completions), bool),
            row_len=ctx.row_len,
            max_tokens=cfg.rollout.max_tokens,
            groups=cfg.train.micro_batches,
            row_multiple=ctx.row_multiple,
        )
        PerToken.batches.append((scored.completions, batch))
        if len(PerToken.batches) == PerToken.terminate_at:  # the process is told to stop mid-step
            os.kill(os.getpid(), signal.SIGTERM)
        return StepData(batch, scored, {"advantage/mean": float(np.mean(np.concatenate(advantages)))})


@pytest.mark.integration
def test_a_method_without_rewards_with_one_sample_and_per_token_advantages(tmp_path, arithmetic_tokenizer, capsys):
    """...that stops on SIGTERM within a step with that step trained and checkpointed, and resumes past it."""
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "rollout.sampler=jax",
            "reward.functions=[]",
            "rl.accuracy_fn=null",
            "rl.batch.num_generations=1",
            "rl.batch.prompts_per_step=4",
            "train.steps=3",
            "train.eval_every=1",
            "checkpoint.every_steps=100",
            "checkpoint.async_save=false",
            "checkpoint.export_hf=false",
        ],
        schema=PostTrainConfig,
    )
    PerToken.terminate_at = 2
    summaries = []
    for _ in range(2):  # stopped at step 2, then the same command again
        run = build_sampler_run(cfg, PerToken())
        try:
            summaries.append(run.train())
        finally:
            run.close()
    out = capsys.readouterr().out
    assert "SIGTERM: checkpoint saved at step 2; exiting" in out and "resumed from" in out
    assert [(s.steps, s.policy_version) for s in summaries] == [(2, 2), (3, 3)]  # each step trained and synced
    assert summaries[1].final_eval is None  # no accuracy function: nothing to evaluate with, no evaluation ran
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "3"]
    assert len(PerToken.batches) == 3
    completions, batch = PerToken.batches[0]
    assert len(completions) == 4  # one sample a prompt
    mask = np.asarray(batch.packed.target_mask) > 0
    for i, c in enumerate(completions):  # the advantages reached the batch token by token
        n = len(c.token_ids)
        np.testing.assert_allclose(np.asarray(batch.advantages)[i, :n], -np.asarray(c.logprobs), rtol=1e-6)
        assert not np.asarray(batch.advantages)[i, n:].any() and mask[i, :n].all()
    assert len({float(v) for v in np.asarray(batch.advantages)[mask]}) > 4  # not one value per sequence
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert not any(k.startswith("reward/") or k == "accuracy" for r in rows for k in r)
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows if "loss" in r)
