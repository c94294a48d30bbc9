"""`ray job submit` of the GRPO recipe to a running cluster (a local head started for the test)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    gcs, dashboard = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    started = subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--port", str(gcs),
                              "--dashboard-port", str(dashboard), "--include-dashboard", "true",
                              "--disable-usage-stats", "--temp-dir", temp],
                             env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_the_grpo_recipe(ray_head, tmp_path, arithmetic_tokenizer):
    from ray.job_submission import JobStatus, JobSubmissionClient

    os.environ["RAY_AUTH_MODE"] = "disabled"
    client = JobSubmissionClient(ray_head)
    run_dir = tmp_path / "run"
    # The documented command (docs/grpo.md) with --working-dir .; here the cluster shares this
    # machine's checkout, so the entrypoint starts in it instead of uploading it.
    job = client.submit_job(
        entrypoint=f"cd {ROOT} && {sys.executable} -m recipes.grpo recipes/configs/grpo_tiny.yml "
                   f"run.run_dir={run_dir} data.tokenizer_dir={arithmetic_tokenizer} train.steps=2",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}},
    )
    deadline = time.monotonic() + 600
    status = client.get_job_status(job)
    while status not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED} and time.monotonic() < deadline:
        time.sleep(1)
        status = client.get_job_status(job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "Connected to Ray cluster" in logs or "Connecting to existing Ray cluster" in logs  # attached, not local
    steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
