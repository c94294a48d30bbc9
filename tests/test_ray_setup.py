"""Ray start-up: a local cluster is the run's own, listens on loopback only and keeps Ray's auth; attaching
changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LISTENERS = """
import os, sys, psutil
from rollout.ray import ensure_ray
ensure_ray(num_cpus=1)
import ray
addresses = set()
for p in psutil.Process(os.getpid()).children(recursive=True):
    try:
        addresses |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
print("listening on", sorted(addresses))
print("auth mode", os.environ.get("RAY_AUTH_MODE"))
ray.shutdown()
"""


@pytest.mark.serial  # starts a local Ray cluster: never beside another test's
def test_a_local_cluster_listens_on_loopback_only_and_keeps_rays_auth():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", LISTENERS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("listening on"))
    addresses = eval(line.removeprefix("listening on "))  # a list literal of IP strings
    assert addresses and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in addresses), addresses
    assert "auth mode token" in out.stdout  # Ray 2.60's default for a local cluster, which Temper no longer turns off
    assert "warning" not in out.stderr.lower()  # neither ours (Ray imported early) nor Ray's about its default


def test_attaching_leaves_the_clusters_settings_alone(monkeypatch):
    import ray

    from rollout import ray as temper_ray

    calls = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://head.example:10001")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv(temper_ray.SINGLE_MACHINE, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    before = dict(os.environ)
    temper_ray.ensure_ray()
    assert calls == [{"address": "ray://head.example:10001", "log_to_driver": False}]
    assert dict(os.environ) == before  # no auth mode, no token, no node-address switch


OWN_CLUSTER = """
from rollout.ray import ensure_ray
ensure_ray(num_cpus=1)
import ray
print("gcs", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


@pytest.mark.integration
@pytest.mark.serial
def test_a_local_run_starts_its_own_cluster_beside_another_one():
    """Another cluster runs on this machine (a test's `Cluster`, or `ray start`, which leave their address where
    Ray looks for the last one): a run without `RAY_ADDRESS` starts its own, not attaching to that one (whose end
    would end the run)."""
    from ray.cluster_utils import Cluster

    from rollout.ray import quiet_fork_exec

    with quiet_fork_exec():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run(
            [sys.executable, "-c", OWN_CLUSTER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
        )
    finally:
        cluster.shutdown()
    assert out.returncode == 0, out.stderr[-2000:]
    gcs = next(line for line in out.stdout.splitlines() if line.startswith("gcs ")).split()[1]
    assert gcs != cluster.address, (gcs, cluster.address)
