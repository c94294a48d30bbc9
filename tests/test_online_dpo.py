"""Online DPO: best / worst pairs from graded samples (vs a NumPy reference), and the loop end to end with the real
vLLM sampler on Ray, learning a reward, resuming from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from rollout.sampler import Completion

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "configs" / "dpo_online_tiny.yml"


def completions(n: int, seed: int) -> list[Completion]:
    rng = np.random.default_rng(seed)
    return [
        Completion([1, 2, i // 4 + 3], [int(x) for x in rng.integers(5, 50, 1 + i % 3)], None, "stop", f"c{i}")
        for i in range(n)
    ]


def test_best_worst_pairs_match_a_numpy_reference():
    from posttrain.online_dpo import best_worst_pairs

    comps = completions(24, seed=0)  # 6 prompts x 4 samples
    rewards = np.array(
        [0.1, 0.9, 0.9, 0.0]  # best: first of the two 0.9s, worst the 0.0
        + [0.5] * 4  # tie: no pair
        + [0.2, np.nan, 0.3, 0.1]  # a failed reward: no pair
        + [-1.0, -3.0, 2.0, -3.0]  # worst: first of the two -3.0s
        + [0.0, 0.0, 0.0, 1e-9]
        + [7.0, 6.0, 5.0, 4.0],
        np.float32,
    )
    pairs, ties, failed = best_worst_pairs(comps, rewards, 4)
    assert (ties, failed) == (1, 1)
    want = []
    for g in range(6):
        r = rewards[4 * g : 4 * g + 4].astype(np.float64)
        if np.isnan(r).any() or r.max() == r.min():
            continue
        best = min(j for j in range(4) if r[j] == r.max())
        worst = min(j for j in range(4) if r[j] == r.min())
        want.append((g, comps[4 * g + best].token_ids, comps[4 * g + worst].token_ids))
    assert [(p.row, list(p.chosen), list(p.rejected)) for p in pairs] == want
    assert [g for g, _, _ in want] == [0, 3, 4, 5]
    assert all(list(p.prompt) == comps[4 * p.row].prompt_ids for p in pairs)


def test_online_settings_are_checked(tmp_path):
    from posttrain.online_dpo import check_online_config

    for override, match in (
        ("rl.batch.mini_batches=2", "one update per step"),
        ("train.micro_batches=8", "prompts_per_step=4 is not divisible by train.micro_batches=8"),
    ):
        with pytest.raises(ConfigError, match=match):
            check_online_config(load_config(TINY, [override]))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rollout.ray import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.mark.integration
def test_online_dpo_on_ray_with_vllm_learns_the_reward_and_resumes(ray_cluster, tmp_path, arithmetic_tokenizer):
    """Real Ray, real vLLM, a reward a random tiny model can learn (share of digits): pairs of its own best and
    worst samples raise the reward over 8 steps; the weights reach the sampler after every update; a second run
    on the same directory resumes at the last checkpoint."""
    from posttrain.online_dpo import OnlineDPORun

    cfg = load_config(
        TINY,
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "reward.functions=[{fn: tests.reward_plugins:digit_share}]",
            "rl.accuracy_fn=tests.reward_plugins:digit_share",
            "rl.batch.prompts_per_step=8",
            "rollout.max_tokens=8",
            "optim.learning_rate=1.0e-2",
            "train.steps=8",
            "train.eval_every=8",
            "rl.eval_prompts=4",
            "rl.eval_samples=2",
            "checkpoint.every_steps=4",
        ],
    )
    run = OnlineDPORun(cfg)
    try:
        summary = run.run()
        assert run.samplers.samplers[0].policy_version == run.trainer.version() == summary.steps == 8
    finally:
        run.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [m["step"] for m in steps] == list(range(1, 9))
    for m in steps:
        assert m["pairs"] + m["pairs/ties"] + m["pairs/failed"] == 8 and m["pairs/failed"] == 0
        assert m["policy_version"] == m["step"]
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
            assert np.isfinite(m[key]), key
    assert abs(steps[0]["loss"] - np.log(2)) < 1e-4  # policy == reference at the first update
    first, last = np.mean([m["reward/mean"] for m in steps[:2]]), np.mean([m["reward/mean"] for m in steps[-2:]])
    print(f"reward: steps 1-2 {first:.3f}, steps 7-8 {last:.3f}")
    assert last > first + 0.3
    assert (tmp_path / "run" / "hf").exists() and (tmp_path / "run" / "reward.png").exists()

    again = OnlineDPORun(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 9})}))
    try:
        assert again.start_step == 8 and again.trainer.version() == 8
    finally:
        again.close()


@pytest.mark.integration
def test_a_step_whose_prompts_all_tie_makes_no_update(tmp_path, arithmetic_tokenizer):
    """A reward that never varies gives no pair: the step logs its ties, trains nothing and syncs nothing; the
    policy version stays 0 (JAX sampler, one process)."""
    from posttrain.online_dpo import OnlineDPORun
    from posttrain.onpolicy.loop import run_to_end

    cfg = load_config(
        TINY,
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "rollout.sampler=jax",
            "reward.functions=[{fn: format, kwargs: {pattern: 'never matches'}}]",
            "rl.accuracy_fn=format",
            "train.steps=2",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
        ],
    )
    run = OnlineDPORun(cfg)
    summary = run_to_end(run)
    assert summary.policy_version == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["pairs"], r["pairs/ties"], r["time/sync_s"]) for r in rows] == [(0.0, 4.0, 0.0)] * 2
    assert not any("loss" in r for r in rows)
