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
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_cluster_options(num_cpus: int | None = None) -> dict:
    """The `ray.init` keyword arguments of a private local cluster: always a new one (`address="local"`), never the
    cluster another process on this machine started (Ray's own default attaches to the last one `ray start` or a
    test's `Cluster` left its address for, and that cluster's end would end this run)."""
    return dict(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=os.environ.get("TEMPER_RAY_DASHBOARD") == "1",
        dashboard_host="127.0.0.1",
        log_to_driver=False,
    )


@contextlib.contextmanager
def quiet_fork_exec():
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
    with quiet_fork_exec():
        ray.init(**local_cluster_options(num_cpus))


def node_alive(node_id: str, settle_s: float = 5.0) -> bool:
    """Whether Ray node `node_id` is alive in the cluster this process is connected to, asked again for up to
    `settle_s` (an actor's death can reach the caller before its node's does); False when the cluster cannot be
    asked (a sampler is then not restarted on it)."""
    import ray

    deadline = time.monotonic() + settle_s
    while True:
        try:
            alive = any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
        except Exception:
            return False
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.5)


def jax_actor_env(gpus: bool, cpu_devices: int | None = None) -> dict[str, str]:
    """The environment a Ray actor running JAX starts with: this process's XLA / JAX settings, the CPU platform
    where the actor gets no GPU (with `cpu_devices` XLA host devices, if given), and the host malloc
    (`core.host_memory.malloc_tunables`)."""
    from core.host_devices import with_host_device_count
    from core.host_memory import malloc_tunables

    env = {k: v for k, v in os.environ.items() if k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64")}
    env.setdefault("JAX_PLATFORMS", "" if gpus else "cpu")
    if cpu_devices is not None and not gpus:
        env["XLA_FLAGS"] = with_host_device_count(env.get("XLA_FLAGS", ""), cpu_devices)
    env["GLIBC_TUNABLES"] = malloc_tunables()
    return env


def call_actor(
    actor: Any, method: Callable, args: tuple, timeout_s: float, unavailable: Callable[[str, Exception], Exception]
) -> Any:
    """`method` (a method of the actor's class, so the call is checked against it) run on `actor`, waited for at
    most `timeout_s`. An error the method raised inside the live actor comes back as itself, not wrapped in Ray's
    `RayTaskError`; a dead actor, a lost cluster or a timeout raises `unavailable(method name, Ray's error)`."""
    return call_group([actor], method, args, timeout_s, lambda err, _: unavailable(method.__name__, err))[0]


def call_group(
    actors: Sequence[Any],
    method: Callable,
    args: tuple,
    timeout_s: float,
    unavailable: Callable[[Exception, int], Exception],
    grace_s: float = 10.0,
) -> list:
    """`method` run on every one of `actors` with the same arguments (a process group takes each call together,
    SPMD; the arguments are put in the object store once), their answers in order, all within `timeout_s`.

    The first failure ends the wait. An actor that died, a lost cluster or a timeout raises
    `unavailable(Ray's error, the actor's index)`. An error raised inside a live actor comes back as itself, unless
    another actor of the group is found dead within `grace_s` (a process whose peer died fails in the collective it
    shared with it: the death is the cause worth naming)."""
    import ray

    if len(actors) > 1:
        args = tuple(ray.put(a) for a in args)  # Ray resolves top-level references: each actor reads one copy
    refs = [getattr(a, method.__name__).remote(*args) for a in actors]
    return wait_group(refs, timeout_s, unavailable, grace_s)


def wait_group(
    refs: Sequence[Any], timeout_s: float, unavailable: Callable[[Exception, int], Exception], grace_s: float = 10.0
) -> list:
    """The results of one call per actor of a group (`refs`, in actor order), as `call_group` waits for them."""
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            late = index[pending[0]]
            raise unavailable(ray.exceptions.GetTimeoutError(f"no answer within {timeout_s:.0f} s"), late) from None
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as err:
            dead = _first_dead(pending, index, grace_s) if pending else None
            if dead is not None:
                raise unavailable(*dead) from None
            raise err.cause from None
        except (ray.exceptions.RayError, ConnectionError) as err:
            raise unavailable(err, index[done[0]]) from None
    return ray.get(list(refs))


def _first_dead(pending: list, index: dict, grace_s: float) -> tuple[Exception, int] | None:
    """(Ray's error, index) of the first of `pending` calls whose actor is found dead within `grace_s`, or None."""
    import ray

    deadline = time.monotonic() + grace_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            return None
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError:
            continue
        except (ray.exceptions.RayError, ConnectionError) as err:
            return err, index[done[0]]
    return None
