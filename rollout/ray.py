"""Ray start-up: attach to the cluster a job runs on, or start a private local one.

    ensure_ray()            # inside `ray job submit` (RAY_ADDRESS set): attach; else a local cluster

Attaching leaves the cluster as its owner set it up: Temper never sets
`RAY_AUTH_MODE`, tokens or any other setting of a cluster, so a
token-authenticated cluster keeps its tokens (docs/grpo.md says how to submit
to one). A local cluster is Temper's own: it uses token auth, Ray 2.60's
default for local clusters (`RAY_AUTH_MODE=token` unless you set the mode
yourself; said explicitly, Ray does not warn about its default on every run;
the token is `~/.ray/auth_token`, generated when missing), listens on
127.0.0.1 only, and starts no dashboard unless `TEMPER_RAY_DASHBOARD=1`.

Loopback only: Ray picks a node's address when it is imported, and binds its
servers to it; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is Ray's own switch for
a single-machine cluster (its default on macOS and Windows), which makes that
address 127.0.0.1. `ensure_ray` sets it (and the auth mode) before importing
Ray; if Ray was imported earlier in the process, the local cluster listens
where Ray decided, and a warning says so.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_cluster_options(num_cpus: int | None = None) -> dict:
    """The `ray.init` keyword arguments of a private local cluster."""
    return dict(
        num_cpus=num_cpus,
        include_dashboard=os.environ.get("TEMPER_RAY_DASHBOARD") == "1",
        dashboard_host="127.0.0.1",
        log_to_driver=False,
    )


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
    address = os.environ.get("RAY_ADDRESS")
    if not address and "ray" not in sys.modules:  # both are read by Ray when it is imported
        os.environ.setdefault(SINGLE_MACHINE, "0")  # node address 127.0.0.1
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's default for a local cluster, said explicitly
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        print(
            "warning: Ray was imported before rollout.ray.ensure_ray, so the local Ray cluster listens on "
            "this machine's network address, not on 127.0.0.1 only",
            file=sys.stderr,
            flush=True,
        )
    with _quiet_fork_exec():
        ray.init(**local_cluster_options(num_cpus))


def jax_actor_env(gpus: bool) -> dict[str, str]:
    """The environment a Ray actor running JAX starts with: this process's XLA / JAX settings, the CPU platform
    where the actor gets no GPU, and the host malloc (`core.host_memory.malloc_tunables`)."""
    from core.host_memory import malloc_tunables

    env = {k: v for k, v in os.environ.items() if k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64")}
    env.setdefault("JAX_PLATFORMS", "" if gpus else "cpu")
    env["GLIBC_TUNABLES"] = malloc_tunables()
    return env


def call_actor(
    actor: Any, method: Callable, args: tuple, timeout_s: float, unavailable: Callable[[str, Exception], Exception]
) -> Any:
    """`method` (a method of the actor's class, so the call is checked against it) run on `actor`, waited for at
    most `timeout_s`. An error the method raised inside the live actor comes back as itself, not wrapped in Ray's
    `RayTaskError`; a dead actor, a lost cluster or a timeout raises `unavailable(method name, Ray's error)`."""
    import ray

    try:
        return ray.get(getattr(actor, method.__name__).remote(*args), timeout=timeout_s)
    except ray.exceptions.RayTaskError as err:
        raise err.cause from None
    except (ray.exceptions.RayError, ConnectionError) as err:
        raise unavailable(method.__name__, err) from None
