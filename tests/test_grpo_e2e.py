"""GRPO end to end: the real vLLM sampler on Ray (sync and async), a killed sampler, kill -9 and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from core.config_loader import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "configs" / "grpo_tiny.yml"
# A reward with variance on a random model, so every group carries signal.
VARIED_REWARD = "reward.functions=[{fn: tests.reward_plugins:char_count, weight: 0.01}]"


def tiny_cfg(run_dir, tokenizer, *overrides):
    return load_config(TINY, [f"run.run_dir={run_dir}", f"data.tokenizer_dir={tokenizer}", VARIED_REWARD, *overrides])


def read_metrics(run_dir):
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r for r in rows if "reward/mean" in r}, [r for r in rows if "eval/pass@1" in r]


def hf_weights(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rollout.ray import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_grpo_on_ray_with_vllm_learns_syncs_and_survives_a_dead_sampler(ray_cluster, tmp_path, arithmetic_tokenizer):
    import ray

    from posttrain.grpo import GRPORun

    cfg = tiny_cfg(tmp_path / "run", arithmetic_tokenizer, "train.steps=4", "train.eval_every=4",
                   "rl.eval_prompts=4", "rl.eval_samples=2")
    killed = {}

    def kill_sampler_after_step_2(run, step, metrics):
        if step == 2:
            killed["handle"] = run.samplers.samplers[0].handle
            ray.kill(killed["handle"])

    run = GRPORun(cfg)
    try:
        summary = run.run(on_step=kill_sampler_after_step_2)
        new_sampler = run.samplers.samplers[0]
        assert new_sampler.handle != killed["handle"]
        assert new_sampler.policy_version == run.trainer.version() == 4
    finally:
        run.close()

    steps, evals = read_metrics(summary.run_dir)
    assert sorted(steps) == [1, 2, 3, 4]
    for s, m in steps.items():
        assert m["policy_version"] == s  # the sampler follows the trainer after every sync
        assert m["staleness_max"] == 0
        assert 0 <= m["mismatch/logp_gap_mean"] < 1e-4 and m["mismatch/logp_gap_max"] < 1e-3  # float32 vLLM vs JAX
        for key in ("reward/std", "reward/char_count/mean", "reward/char_count/failure_rate", "accuracy",
                    "completion_length/mean", "truncation_rate", "clip_fraction", "entropy", "zero_variance_groups",
                    "time/generate_s", "time/reward_s", "time/train_s", "time/sync_s", "tokens_per_s"):
            assert np.isfinite(m[key]), key
    assert [steps[s]["sampler_restarts"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert evals and {"eval/pass@1", "eval/pass@2", "eval/maj@2"} <= set(evals[0])

    before, after = hf_weights(run.init_hf), hf_weights(summary.hf_dir)
    assert before.keys() == after.keys()
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, changed
    assert (summary.run_dir / "reward.png").exists()


def test_async_mode_keeps_completions_within_the_staleness_bound(ray_cluster, tmp_path, arithmetic_tokenizer):
    from posttrain.grpo import run_grpo

    cfg = tiny_cfg(tmp_path / "run", arithmetic_tokenizer, "train.steps=4", "rl.off_policy_steps=1",
                   "checkpoint.export_hf=false")
    summary = run_grpo(cfg)
    steps, _ = read_metrics(summary.run_dir)
    # Step 1 trains on a batch of version 0 with the trainer at 0; from then on the next batch was
    # generated while the trainer trained, one version behind: exactly the bound, never more.
    assert [steps[s]["staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert summary.policy_version == 4


def test_staleness_check_refuses_old_completions():
    from posttrain.grpo import StalenessError, check_staleness
    from rollout.sampler import Completion

    batch = [Completion([1], [2], [0.0], "stop", "x", policy_version=v) for v in (3, 4)]
    assert check_staleness(batch, 5, 2) == 2
    with pytest.raises(StalenessError, match="version 3 reached the trainer at version 5: 2 > rl.off_policy_steps=1"):
        check_staleness(batch, 5, 1)


def _recipe(run_dir, tokenizer, steps):
    cmd = [sys.executable, "-m", "recipes.grpo", str(TINY), f"run.run_dir={run_dir}",
           f"data.tokenizer_dir={tokenizer}", VARIED_REWARD, "rollout.sampler=jax", f"train.steps={steps}",
           "checkpoint.every_steps=1", "checkpoint.keep=3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return cmd, env


def test_resume_after_kill_9_matches_an_uninterrupted_run(tmp_path, arithmetic_tokenizer):
    steps = 12
    cmd, env = _recipe(tmp_path / "whole", arithmetic_tokenizer, steps)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, timeout=600)

    cmd, env = _recipe(tmp_path / "killed", arithmetic_tokenizer, steps)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ckpt = tmp_path / "killed" / "checkpoints" / "4"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    whole, _ = read_metrics(tmp_path / "whole")
    again, _ = read_metrics(tmp_path / "killed")
    assert sorted(again) == list(range(1, steps + 1))  # one uninterrupted-looking history
    for s in range(1, steps + 1):
        for key in ("reward/mean", "loss", "completion_length/mean", "policy_version"):
            assert again[s][key] == pytest.approx(whole[s][key], abs=1e-6), (s, key)
    a, b = hf_weights(tmp_path / "whole" / "hf"), hf_weights(tmp_path / "killed" / "hf")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6
