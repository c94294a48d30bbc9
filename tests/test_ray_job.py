"""`ray job submit` of the GRPO recipe to a running, token-authenticated cluster (a local head started for the
test), with the documented command: the job attaches to the cluster and leaves its auth as the owner set it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.serial]

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head():
    """(dashboard address, the env a client of this cluster uses: its auth mode and token)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    gcs, dashboard = _free_port(), _free_port()
    token = secrets.token_hex(32)
    owner = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    owner.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    started = subprocess.run(
        [
            RAY,
            "start",
            "--head",
            "--num-cpus",
            "2",
            "--port",
            str(gcs),
            "--dashboard-port",
            str(dashboard),
            "--include-dashboard",
            "true",
            "--disable-usage-stats",
            "--temp-dir",
            temp,
        ],
        env=owner,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}", owner
    finally:
        subprocess.run([RAY, "stop", "--force"], env=owner, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_the_grpo_recipe_on_an_authenticated_cluster(ray_head, tmp_path, arithmetic_tokenizer):
    address, client_env = ray_head
    stranger = {**client_env, "RAY_AUTH_TOKEN": "not-the-token"}
    refused = subprocess.run(
        [RAY, "job", "list", "--address", address], env=stranger, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0  # the cluster really is authenticated

    run_dir = tmp_path / "run"
    # The documented command (docs/grpo.md) without --working-dir: the cluster shares this machine's checkout,
    # so the entrypoint starts in it instead of uploading it.
    entrypoint = (
        f"cd {ROOT} && {sys.executable} -m recipes.grpo recipes/configs/grpo_tiny.yml "
        f"run.run_dir={run_dir} data.tokenizer_dir={arithmetic_tokenizer} train.steps=1"
    )
    runtime_env = json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}})
    job = subprocess.run(
        [RAY, "job", "submit", "--address", address, "--runtime-env-json", runtime_env, "--", "bash", "-c", entrypoint],
        env=client_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs[-3000:]
    assert "Connected to Ray cluster" in logs or "Connecting to existing Ray cluster" in logs  # attached, not local
    steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
