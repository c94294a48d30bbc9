"""Online DPO: best / worst pairs from graded samples (vs a NumPy reference), and the loop end to end with the real
vLLM sampler on Ray, learning a reward, resuming from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig
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
    from posttrain.dpo.online import best_worst_pairs

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
    pairs, left_out = best_worst_pairs(comps, rewards, 4)
    assert left_out == {"ties": 1, "failed": 1, "identical": 0}
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


def test_missing_eos_penalty_and_identical_samples():
    """A sample cut at the length limit loses `dpo.missing_eos_penalty` from its reward before the pair is picked
    (here it stops being the best); best and worst samples with the same tokens make no pair."""
    from posttrain.dpo.online import best_worst_pairs

    comps = completions(8, seed=1)
    comps[1].finish_reason = "length"  # the best by reward, but truncated
    rewards = np.array([0.5, 1.0, 0.6, 0.0, 0.3, 0.9, 0.3, 0.3], np.float32)
    comps[5].token_ids = list(comps[4].token_ids)  # group 2: its best and worst are the same tokens
    (plain,), left_out = best_worst_pairs(comps, rewards, 4)
    assert list(plain.chosen) == comps[1].token_ids and left_out["identical"] == 1
    (penalised,), _ = best_worst_pairs(comps, rewards, 4, missing_eos_penalty=1.0)
    assert list(penalised.chosen) == comps[2].token_ids  # 1.0 - 1.0 < 0.6
    assert list(penalised.rejected) == comps[1].token_ids  # and now the worst


def test_online_settings_are_checked(tmp_path):
    from posttrain.dpo.online import check_config

    for override, match in (
        ("rl.batch.mini_batches=2", "one update per step"),
        ("train.micro_batches=8", "prompts_per_step=4 is not divisible by train.micro_batches=8"),
        ("rl.batch.num_generations=1", "num_generations >= 2"),
        ("rl.batch.pack_length=130", r"rl.batch.pack_length \(130\) cannot hold a sampled pair"),
    ):
        with pytest.raises(ConfigError, match=match):
            check_config(load_config(TINY, [override], schema=PostTrainConfig))


def test_a_long_sampled_pair_fits_its_row():
    """With the GSM8K 1.5B config's limits (max_tokens 768, max_model_len 1280) a prompt of 512 tokens and two
    full-length completions (1280 + 768 tokens) lays out in one row: the rows are as long as a pair can be."""
    from posttrain.dpo.online import pair_length
    from posttrain.dpo.pairs import Pair, build_pair_batch

    cfg = load_config(
        TINY, ["rollout.max_tokens=768", "rollout.max_model_len=1280", "rl.batch.pack_length=0"], schema=PostTrainConfig
    )
    longest = Pair(0, tuple(range(1, 513)), tuple([7] * 768), tuple([8] * 768))
    assert longest.length == 2048 == pair_length(cfg)
    batch = build_pair_batch([longest], slots=4, row_len=pair_length(cfg))
    assert int((np.asarray(batch.packed.segment_ids) > 0).sum()) == 2048


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rollout.ray import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.mark.integration
@pytest.mark.serial
def test_online_dpo_on_ray_with_vllm_learns_the_reward(ray_cluster, tmp_path, arithmetic_tokenizer):
    """Real Ray, real vLLM, a reward a random tiny model can learn (share of digits): pairs of its own best and
    worst samples raise the reward over 8 steps; the weights reach the sampler after every update. (Resuming is
    the on-policy run's, tested with GRPO and on-policy distillation.)"""
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.onpolicy.run import build_sampler_run

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
        schema=PostTrainConfig,
    )
    run = build_sampler_run(cfg, ONLINE_DPO)
    try:
        summary = run.train()
        assert run.source.samplers.samplers[0].policy_version == run.trainer.version() == summary.steps == 8
    finally:
        run.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [m["step"] for m in steps] == list(range(1, 9))
    for m in steps:
        assert m["pairs"] + m["pairs/ties"] + m["pairs/failed"] + m["pairs/identical"] == 8
        assert m["pairs/failed"] == 0
        assert m["policy_version"] == m["step"]
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
            assert np.isfinite(m[key]), key
    assert abs(steps[0]["loss"] - np.log(2)) < 1e-4  # policy == reference at the first update
    first, last = np.mean([m["reward/mean"] for m in steps[:2]]), np.mean([m["reward/mean"] for m in steps[-2:]])
    print(f"reward: steps 1-2 {first:.3f}, steps 7-8 {last:.3f}")
    assert last > first + 0.3
    assert (tmp_path / "run" / "hf").exists() and (tmp_path / "run" / "reward.png").exists()


@pytest.mark.integration
def test_a_step_whose_prompts_all_tie_makes_no_update(tmp_path, arithmetic_tokenizer):
    """A reward that never varies gives no pair: the step logs its ties, trains nothing and syncs nothing; the
    policy version stays 0 (JAX sampler, one process)."""
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.onpolicy.run import build_sampler_run

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
        schema=PostTrainConfig,
    )
    run = build_sampler_run(cfg, ONLINE_DPO)
    summary = run.fit()
    assert summary.policy_version == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["pairs"], r["pairs/ties"], r["time/sync_s"]) for r in rows] == [(0.0, 4.0, 0.0)] * 2
    assert not any("loss" in r for r in rows)


def test_the_longest_pair_the_samplers_can_produce_trains_in_one_row():
    """`ONLINE_DPO.from_samples` on a step whose one pair is as long as vLLM allows (a 512-token prompt, its best sample
    filling max_model_len with it, its worst max_tokens long), with the GSM8K 1.5B config's limits: the pair lays
    out whole in one row of `row_length()`, where rows of max_model_len (the old layout) raised mid-run."""
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.onpolicy.method import SampleContext
    from posttrain.onpolicy.step import Scored
    from rewards.runner import RewardBatch

    cfg = load_config(
        TINY,
        [
            "rollout.max_tokens=768",
            "rollout.max_model_len=1280",
            "rl.batch.prompts_per_step=1",
            "train.micro_batches=1",
        ],
        schema=PostTrainConfig,
    )
    row_len = ONLINE_DPO.row_length(cfg)
    prompt = list(range(3, 515))
    samples = [
        Completion(prompt, [7] * 768, None, "length", "a"),
        Completion(prompt, [8] * 700, None, "stop", "b"),
        Completion(prompt, [9] * 10, None, "stop", "c"),
        Completion(prompt, [6] * 768, None, "length", "d"),
    ]
    rewards = np.array([1.0, 0.5, 0.2, 0.0], np.float32)
    scored = Scored([{"question": "q"}], samples, RewardBatch(rewards, {"r": rewards}, {"r": rewards != rewards}), None)
    data = ONLINE_DPO.from_samples(cfg, scored, SampleContext(1, row_len, 1, None, more=lambda: scored))
    assert data.metrics["pairs"] == 1 and data.batch is not None
    segment = np.asarray(data.batch.packed.segment_ids)
    assert row_len == 2048 and segment.shape[1] == 2048 and int((segment > 0).sum()) == 512 + 768 + 768
