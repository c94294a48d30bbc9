"""GRPO end to end: the staleness bound, kill -9 and an exact resume with the JAX sampler (LoRA), and async
multi-turn GRPO on a vLLM engine on Ray that survives a lost Ray head and resumes exactly as a Ray job (a killed
sampler's restart is in tests/test_trainer_group.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config_loader import load_config
from core.distributed import free_port
from posttrain.config import PostTrainConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "configs" / "grpo_tiny.yml"
# A reward with variance on a random model, so every group carries signal.
VARIED_REWARD = "reward.functions=[{fn: tests.reward_plugins:char_count, weight: 0.01}]"


def tiny_cfg(run_dir, tokenizer, *overrides):
    return load_config(
        TINY,
        [f"run.run_dir={run_dir}", f"data.tokenizer_dir={tokenizer}", VARIED_REWARD, *overrides],
        schema=PostTrainConfig,
    )


def metric_rows(run_dir):
    """(training-step rows in file order, eval rows): raw lists, so a duplicated step shows."""
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in rows if "reward/mean" in r], [r for r in rows if "eval/pass@1" in r]


def test_staleness_check_refuses_old_completions():
    from posttrain.onpolicy.checks import StalenessError, check_staleness
    from rollout.sampler import Completion

    batch = [Completion([1], [2], [0.0], "stop", "x", policy_version=v) for v in (3, 4)]
    assert check_staleness(batch, 5, 2) == 2
    with pytest.raises(StalenessError, match="version 3 reached the trainer at version 5: 2 > rl.off_policy_steps=1"):
        check_staleness(batch, 5, 1)
    # an episode that failed before its first turn was never sampled: it has no version to be stale by
    never = Completion([], [], [], "stop", "", policy_version=0)
    assert check_staleness([*batch, never], 5, 2) == 2 and check_staleness([never], 5, 0) == 0


def run_until(cmd, env, run_dir, checkpoint, step, timeout_s=400):
    """Start the recipe and return its process once checkpoint `checkpoint` exists and step `step` is logged."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if (
            (run_dir / "checkpoints" / str(checkpoint)).exists()
            and metrics.exists()
            and f'"step": {step},' in metrics.read_text()
        ):
            return proc
        time.sleep(0.02)
    raise AssertionError(f"the run ended or stalled before step {step}: " + "".join(proc.communicate()[1:])[-3000:])


REDONE_KEYS = ("reward/mean", "loss", "completion_length/mean", "policy_version", "mismatch/logp_gap_mean")


def assert_redone_steps_match(before_kill, after, resumed_from, keys=REDONE_KEYS):
    """Steps resumed_from+1 .. the last logged before the kill were redone; they log what they logged before."""
    redone = [m for m in before_kill if m["step"] > resumed_from]
    assert redone, "nothing to compare: the kill came right after the checkpoint"
    for old in redone:
        new = after[old["step"] - 1]
        for key in keys:
            assert new[key] == pytest.approx(old[key], abs=1e-6), (old["step"], key)


def kill_9_and_resume(cmd, run_dir, steps, checkpoint=2):
    """Run the recipe `cmd`, SIGKILL its process group one step after checkpoint `checkpoint`, then run the same
    command to its end: (the step rows logged before the kill, the step rows after, which are each of 1..`steps`
    once, in order)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_until(cmd, env, run_dir, checkpoint=checkpoint, step=checkpoint + 1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before_kill, _ = metric_rows(run_dir)
    resumed = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {checkpoint}" in resumed.stdout
    after, _ = metric_rows(run_dir)
    assert [m["step"] for m in after] == list(range(1, steps + 1))  # each step once, in order: no gap, no repeat
    return before_kill, after


RAY = str(Path(sys.executable).parent / "ray")


@contextlib.contextmanager
def authenticated_ray_head():
    """A Ray cluster started with `ray start --head` and token auth, as its owner would: yields (its dashboard
    address, the env a client of it uses: its auth mode and token)."""
    import secrets
    import shutil
    import tempfile

    import ray

    if ray.is_initialized():
        ray.shutdown()
    gcs, dashboard = free_port("127.0.0.1"), free_port("127.0.0.1")
    owner = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    owner.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    head = [RAY, "start", "--head", "--num-cpus", "2", "--port", str(gcs), "--dashboard-port", str(dashboard)]
    head += ["--include-dashboard", "true", "--disable-usage-stats", "--temp-dir", temp]
    started = subprocess.run(head, env=owner, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}", owner
    finally:
        subprocess.run([RAY, "stop", "--force"], env=owner, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.serial
def test_async_agents_survive_a_lost_ray_head_and_resume_exactly_as_a_ray_job(tmp_path, tmp_path_factory):
    """The recipe, async GRPO (`rl.off_policy_steps=1`) with `rl.agent` on a vLLM engine: 8 episodes a step, at most
    3 at once (`max_concurrency`), each turn its own request over the episode's tokens, with the environment's
    tokens between the turns; the policy is LoRA adapters, and each sync sends the adapters alone.
    1. The local Ray cluster's GCS and raylet get SIGKILL one step after checkpoint 2 (the node under the driver
       going down, with the next step's episodes in flight): the driver stops within a minute with exit code 2
       and one message (no traceback) saying what happened and how to resume.
    2. The same command, submitted with `ray job submit` (the documented command) to a token-authenticated
       cluster, attaches to it and resumes from checkpoint 2: step 3 trains on the episodes checkpoint 2 stored
       and logs what the stopped run logged, every step is logged once, and staleness stays within the bound.
    Step 1's episodes were sampled on the weights the trainer holds: the trainer's log-probs of the engine's tokens
    equal the engine's own (float32), so the trajectory it reads is the engine's tokens, never re-encoded."""
    import shlex

    import psutil

    from tests.test_agent_run import stopping_model
    from tests.test_chat import make_tokenizer

    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    model_dir = stopping_model(tmp_path / "model", tok, "qwen2")
    run_dir = tmp_path / "run"
    chatter = ROOT / "tests" / "test_agent_run.py"
    agent = f"rl.agent={{environment: '{chatter}:Chatter', max_turns: 3, max_concurrency: 3}}"
    args = [
        "-m",
        "recipes.grpo",
        str(TINY),
        f"run.run_dir={run_dir}",
        f"checkpoint.init_from={model_dir}",
        f"data.tokenizer_dir={tok.name_or_path}",
        "rollout.max_tokens=12",
        "rollout.max_model_len=256",
        "rollout.temperature=0.7",
        "train.steps=4",
        "checkpoint.every_steps=2",
        "checkpoint.keep=3",
        "checkpoint.export_hf=false",
        "rl.off_policy_steps=1",
        "rl.batch.prompts_per_step=2",
        agent,
        "model.lora.rank=4",
        "model.lora.target_modules=[q_proj,v_proj]",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_until([sys.executable, *args], env, run_dir, checkpoint=2, step=3)
    node = psutil.Process(proc.pid).children(recursive=True)
    head = [p for p in node if any(name in " ".join(p.cmdline()) for name in ("gcs_server", "raylet"))]
    assert len(head) == 2
    for p in head:
        p.kill()
    _, err = proc.communicate(timeout=120)
    for p in node:  # the rest of the node goes down too (its dashboard agent would hold the next head's port)
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    message = errors[0]
    assert "run the same command again to resume" in message, message
    # Temper's own message when a Ray call fails first; when the driver touches the object store first, Ray's
    # core ends it with _exit(1) and the recipe's parent process (core.supervise) quotes Ray's log instead.
    assert "the trainer actor is unavailable" in message or "Ray's driver log last said: " in message, message
    before_kill, _ = metric_rows(run_dir)

    with authenticated_ray_head() as (address, client_env):
        stranger = {**client_env, "RAY_AUTH_TOKEN": "not-the-token"}
        listing = [RAY, "job", "list", "--address", address]
        refused = subprocess.run(listing, env=stranger, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "Invalid authentication token" in refused.stderr  # authenticated
        # The documented command (docs/grpo.md) without --working-dir: the cluster shares this machine's
        # checkout, so the entrypoint starts in it instead of uploading it.
        entrypoint = f"cd {ROOT} && {shlex.join([sys.executable, *args])}"
        runtime_env = json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}})
        submit = [RAY, "job", "submit", "--address", address, "--runtime-env-json", runtime_env, "--"]
        for _ in range(10):  # a head just started may have no job agent yet: Ray says to try again later
            job = subprocess.run(
                [*submit, "bash", "-c", entrypoint], env=client_env, capture_output=True, text=True, timeout=600
            )
            if "No available agent to submit job" not in job.stdout + job.stderr:
                break
            time.sleep(2)
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-3000:]
    assert "Connected to Ray cluster" in logs or "Connecting to existing Ray cluster" in logs  # attached, not local
    # from checkpoint 2: step 4's update outlasts the kill
    assert re.search(r"resumed from \S*checkpoints/2 at step 2", logs), logs[-3000:]

    after, _ = metric_rows(run_dir)
    assert [m["step"] for m in after] == [1, 2, 3, 4]
    assert [m["staleness_max"] for m in after] == [0, 1, 1, 1]  # one version behind, never more
    assert_redone_steps_match(before_kill, after, 2)
    for key in ("agent/turns", "agent/env_tokens", "agent/model_tokens"):
        assert after[2][key] == pytest.approx(before_kill[2][key], abs=1e-6), key  # the stored episodes
    assert max(m["agent/turns"] for m in after) > 1.5 and min(m["agent/env_tokens"] for m in after) > 0, after
    assert all(m["agent/failed"] == 0 for m in after)
    assert after[0]["mismatch/logp_gap_mean"] < 1e-4  # later steps sample a version behind (async), by design
    # rank-4 adapters of q ([h -> heads * d]) and v ([h -> kv_heads * d]) in every layer, float32
    hf = json.loads((model_dir / "config.json").read_text())
    d = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    q, v = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    adapter_bytes = hf["num_hidden_layers"] * ((hf["hidden_size"] + q) + (hf["hidden_size"] + v)) * 4 * 4
    assert all(m["sync/bytes"] == adapter_bytes for m in after), [m["sync/bytes"] for m in after]
