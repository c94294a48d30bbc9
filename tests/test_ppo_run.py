"""PPO end to end: on Ray with vLLM and the trainer as a two-process JAX group, it learns a reward and exports its
critic apart; with the JAX sampler and LoRA it survives kill -9 and resumes exactly (critic and all: one
checkpoint holds both)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from core.config_loader import load_config
from posttrain.config import PostTrainConfig
from tests.test_grpo_e2e import assert_redone_steps_match, kill_9_and_resume, metric_rows

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PPO_TINY = ROOT / "recipes" / "configs" / "ppo_tiny.yml"
LEARNABLE = [
    "reward.functions=[{fn: tests.reward_plugins:digit_share}]",
    "rl.accuracy_fn=tests.reward_plugins:digit_share",
    "optim.learning_rate=1.0e-2",
    "ppo.critic_learning_rate=1.0e-2",
    "rollout.max_tokens=8",
]


@pytest.mark.serial
def test_ppo_on_ray_with_vllm_and_a_trainer_group_learns_the_reward(tmp_path, arithmetic_tokenizer):
    """Real Ray, real vLLM, the trainer as 2 JAX processes (fsdp 2): the reward (share of digits) goes up over 8
    steps, each step's weights reach the sampler, the critic's values follow the returns, and the end exports the policy
    and, apart, the critic (transformers reads it with its head)."""
    import ray
    from transformers import AutoModelForTokenClassification

    from posttrain.onpolicy.run import build_sampler_run
    from posttrain.ppo import PPO
    from rollout.ray import ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=3)  # two trainer processes and a sampler
    try:
        cfg = load_config(
            PPO_TINY,
            [
                f"run.run_dir={tmp_path / 'run'}",
                f"data.tokenizer_dir={arithmetic_tokenizer}",
                *LEARNABLE,
                "placement.trainer_processes=2",
                "placement.cpu_devices_per_process=1",
                "mesh.fsdp=2",
                "train.steps=8",
                "checkpoint.every_steps=4",
            ],
            schema=PostTrainConfig,
        )
        run = build_sampler_run(cfg, PPO)
        try:
            assert len(run.trainer.processes) == 2
            summary = run.train()
            assert run.source.samplers.samplers[0].policy_version == run.trainer.version() == summary.steps == 8
        finally:
            run.close()
    finally:
        ray.shutdown()
    steps, _ = metric_rows(tmp_path / "run")
    assert [m["step"] for m in steps] == list(range(1, 9))
    for m in steps:
        assert m["policy_version"] == m["step"] and np.isfinite(m["value_loss"]) and np.isfinite(m["loss"])
    first, last = np.mean([m["reward/mean"] for m in steps[:2]]), np.mean([m["reward/mean"] for m in steps[-2:]])
    print(f"reward: steps 1-2 {first:.3f}, steps 7-8 {last:.3f}; value loss {steps[0]['value_loss']:.4f} -> "
          f"{steps[-1]['value_loss']:.4f}")  # fmt: skip
    assert last > first + 0.2
    # The critic follows the returns as they move: its error at the end is under half its largest.
    error = [abs(m["value/mean"] - m["returns/mean"]) for m in steps]
    assert error[-1] < 0.5 * max(error), error
    assert all(m["mismatch/logp_gap_mean"] < 1e-3 for m in steps)  # the sampler holds the trainer's weights
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "run" / "hf" / "critic")
    assert critic.config.num_labels == 1 and (tmp_path / "run" / "hf" / "config.json").exists()
    assert float(critic.score.weight.abs().max()) > 0  # the head trained


def test_ppo_resumes_exactly_after_kill_9_with_the_jax_sampler_and_lora(tmp_path, arithmetic_tokenizer):
    """`python -m recipes.ppo`, the JAX sampler, LoRA adapters on the policy and the critic, SIGKILL one step after
    checkpoint 2 and the same command again: every step logged once, and the redone step logs what it logged before
    (its reward, losses and the critic's values: both models came back from the one checkpoint)."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "recipes.ppo", str(PPO_TINY), f"run.run_dir={run_dir}",
        f"data.tokenizer_dir={arithmetic_tokenizer}", "rollout.sampler=jax", *LEARNABLE, "model.lora.rank=4",
        "model.lora.alpha=16", "train.steps=4", "checkpoint.every_steps=2", "checkpoint.export_hf=false",
    ]  # fmt: skip
    before_kill, after = kill_9_and_resume(cmd, run_dir, steps=4)
    assert_redone_steps_match(
        before_kill, after, 2, ("reward/mean", "loss", "value_loss", "value/mean", "returns/mean", "policy_version")
    )
    assert after[-1]["value/mean"] != 0.0  # the critic's values moved from the zero head: resuming restored them
