"""`rl.rollout_correction` reaches every method that trains with the policy-gradient update, not only GRPO: PPO (its
policy's part) and on-policy distillation (the sampled-token loss) each run two steps on the JAX sampler with a
geometric-mean mask whose bounds, [1.5, 2], leave out a ratio of 1: the sampler's float32 log-probs are the
trainer's, so every sequence is masked, which it can only be if the sampler's log-probs reached the correction
(without them the correction is off, and masks nothing)."""

from __future__ import annotations

import pytest

from core.config_loader import load_config
from posttrain.config import PostTrainConfig
from tests.helpers import step_metrics

CORRECTION = "rl.rollout_correction={mode: geometric_mask, lo: 1.5, hi: 2.0}"


def _common(tmp_path, tokenizer) -> list[str]:
    return [
        f"run.run_dir={tmp_path / 'run'}",
        f"data.tokenizer_dir={tokenizer}",
        "rollout.sampler=jax",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
        "train.steps=2",
        "train.eval_every=0",
        CORRECTION,
    ]


def _assert_corrected(seen: list[dict]) -> None:
    assert len(seen) == 2
    for m in seen:
        assert m["correction/masked_sequences"] == 1.0 and m["correction/masked_tokens"] == 1.0
        assert abs(m["correction/ratio_min"] - 1) < 1e-2 and abs(m["correction/ratio_max"] - 1) < 1e-2
        assert m["correction/weight_mean"] == 0.0


@pytest.mark.integration
def test_ppo_trains_its_policy_with_the_correction(tmp_path, arithmetic_tokenizer):
    from posttrain.ppo import PPO

    cfg = load_config("recipes/configs/ppo_tiny.yml", _common(tmp_path, arithmetic_tokenizer), schema=PostTrainConfig)
    _assert_corrected(step_metrics(cfg, PPO))


@pytest.mark.integration
def test_on_policy_distillation_trains_with_the_correction(tmp_path, arithmetic_tokenizer, teacher):
    from posttrain.distill.onpolicy import ON_POLICY_DISTILL

    overrides = [
        *_common(tmp_path, arithmetic_tokenizer),
        "distill.regime=on_policy",
        f"distill.teacher={teacher}",
        "reward.functions=[]",
        "rl.accuracy_fn=null",
        "rl.batch.num_generations=1",
    ]
    cfg = load_config("recipes/configs/grpo_tiny.yml", overrides, schema=PostTrainConfig)
    _assert_corrected(step_metrics(cfg, ON_POLICY_DISTILL))
