"""Ray start-up: attach to the cluster a job runs on, or start a private local one.

    ensure_ray()            # inside `ray job submit` (RAY_ADDRESS set): attach; else a local cluster

Attaching leaves the cluster as its owner set it up: Temper never changes
`RAY_AUTH_MODE` or any other setting of a cluster it did not start, so a
token-authenticated cluster keeps its tokens (docs/grpo.md says how to submit
to one). A local cluster is Temper's own: it listens on 127.0.0.1 only, starts
no dashboard unless `TEMPER_RAY_DASHBOARD=1`, and runs with token auth off
unless `RAY_AUTH_MODE` is already set (Ray 2.60 turns token auth on for every
local cluster once `~/.ray/auth_token` exists).
"""

from __future__ import annotations

import contextlib
import os
import warnings

LOCAL_HOST = "127.0.0.1"


def local_cluster_options(num_cpus: int | None = None) -> dict:
    """The `ray.init` keyword arguments of a private local cluster."""
    return dict(num_cpus=num_cpus, include_dashboard=os.environ.get("TEMPER_RAY_DASHBOARD") == "1",
                dashboard_host=LOCAL_HOST, _node_ip_address=LOCAL_HOST, log_to_driver=False)


@contextlib.contextmanager
def _quiet_fork_exec():
    """JAX warns on every fork hook in a process that imported it ("os.fork() was called ... deadlock").
    Ray starts its local processes with subprocess + preexec_fn, which runs the hooks but execs at once, which
    is safe; so that warning says nothing here and is silenced, here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        yield


def ensure_ray(num_cpus: int | None = None) -> None:
    """Attach to the running Ray cluster (`RAY_ADDRESS`, as `ray job submit` sets) or start a local one."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private cluster on the loopback interface
    with _quiet_fork_exec():
        ray.init(**local_cluster_options(num_cpus))
