"""A JAX process group of Ray actors: the trainer of any method spread over processes and nodes.

    group = start_group(placement_group, cfg.placement, run_dir, LocalTrainer, (cfg_json, run_dir, ...))
    stats = group.call(LocalTrainer.train, batch)        # every process runs it (SPMD); process 0's answer
    parts = group.call_all(LocalTrainer.sync, sampler)   # every process's answer, in process order
    group.kill()

Each actor is one process of the group, in one bundle of the trainer's placement group (`rollout.placement`).
The driver asks process 0 for the coordinator's address (its node's address and a free port), then every actor
joins (`core.distributed.join`: `jax.distributed.initialize`, gloo collectives on CPU) before JAX looks at a device
and builds the object it hosts (`build(*args)`: the method's `posttrain.trainer.LocalTrainer`, for every method) on
the group's global mesh. From then on the driver sends each call to every
process with the same arguments, so that all run the same programs in the same order, and reads process 0's
answer. Ray Train's JaxTrainer would do the joining only on TPUs, so these are a few actors of Temper's own, as
Levanter's are.

Each process writes its output to `run_dir/logs/trainer-<rank>.log`. A process that dies (or a node or cluster
that goes away) raises `TrainerUnavailable` naming the process and its node; the others are stopped with it (they
would wait in their next collective), and every call has a timeout, so nothing hangs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import PlacementConfig
from core.errors import TemperError


class TrainerUnavailable(TemperError, RuntimeError):
    """A trainer process died, or the Ray cluster it ran on went away; the run resumes from its last checkpoint."""


@dataclass(frozen=True)
class ProcessInfo:
    """Where one trainer process runs (what a message about it names)."""

    rank: int
    processes: int
    node_ip: str
    node_id: str
    pid: int

    def name(self) -> str:
        if self.processes == 1:
            return "the trainer actor"
        where = f"pid {self.pid} on node {self.node_ip} {self.node_id[:8]}"
        return f"trainer process {self.rank} of {self.processes} ({where})"


class GroupProcess:
    """One process of the group, as a Ray actor: it joins the JAX process group, then hosts one object and runs
    the driver's calls on it."""

    def __init__(self, rank: int, processes: int):
        self.rank, self.processes = rank, processes
        self.hosted: Any = None

    def info(self) -> ProcessInfo:
        import ray

        ctx = ray.get_runtime_context()
        return ProcessInfo(self.rank, self.processes, ray.util.get_node_ip_address(), ctx.get_node_id(), os.getpid())

    def coordinator(self) -> str:
        """Where the group's coordinator will listen: this node's address and a free port (asked of process 0)."""
        import ray

        from core.distributed import free_port

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, coordinator: str, timeout_s: int, log: str, build: Callable[..., Any], args: tuple) -> None:
        """Send this process's output to `log`, join the group (before JAX looks at a device), then host
        `build(*args)`, built on the group's devices."""
        from core.distributed import ProcessGroup, join

        _output_to(Path(log))
        join(ProcessGroup(coordinator, self.processes, self.rank, timeout_s))
        self.hosted = build(*args)

    def call(self, method: Callable, args: tuple) -> Any:
        """`method` (one of the hosted object's class) on this process's object."""
        assert self.hosted is not None, "start() first"
        return method(self.hosted, *args)


def _output_to(path: Path) -> None:
    """This process's stdout and stderr (Python's and the libraries' below it) appended to `path`."""
    import sys

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class RayProcessGroup:
    """The driver's handle on the group's actors: calls to every process with a timeout, process 0's answer."""

    def __init__(self, actors: Sequence[Any], run_dir: str | Path, timeout_s: float):
        self.actors, self.run_dir, self.timeout_s = list(actors), Path(run_dir), timeout_s
        self.processes: list[ProcessInfo] = []  # where each actor runs, once started
        self.lost = False  # set once a call found an actor (or its cluster) gone

    def call(self, method: Callable, *args: Any, timeout_s: float | None = None) -> Any:
        """`method` of the hosted object's class on every process (SPMD); process 0's answer."""
        return self.call_all(method, *args, timeout_s=timeout_s)[0]

    def call_all(self, method: Callable, *args: Any, timeout_s: float | None = None) -> list:
        """`method` on every process, their answers in process order (within `timeout_s`, default the group's
        call timeout)."""
        return self.wait(self.submit(method, *args), method.__name__, timeout_s or self.timeout_s)

    def submit(self, method: Callable, *args: Any) -> list:
        """Start `method` on every process and return at once (Ray object refs, in process order; `wait` them).
        The arguments go into the object store once: each actor reads the same copy."""
        import ray

        refs = tuple(ray.put(a) for a in (method, args))
        return [actor.call.remote(*refs) for actor in self.actors]

    def wait(self, refs: list, name: str, timeout_s: float) -> list:
        """The answers of `submit`'s calls (`timeout_s` in all); a dead process, a lost cluster or a timeout raises
        `TrainerUnavailable` naming the process (`rollout.ray.wait_group`)."""
        from rollout.ray import wait_group

        return wait_group(refs, timeout_s, self._failure(name))

    def _failure(self, name: str) -> Callable[[Exception, int], TrainerUnavailable]:
        return lambda err, rank: self.unavailable(name, err, rank)

    def unavailable(self, name: str, err: Exception, rank: int) -> TrainerUnavailable:
        """An actor (or the cluster) is gone: the rest of the group is stopped (it would wait in a collective)."""
        self.lost = True
        who = self.processes[rank].name() if rank < len(self.processes) else f"trainer process {rank}"
        if len(self.actors) > 1:
            self.kill()
        stopped = " The other trainer processes were stopped." if len(self.actors) > 1 else ""
        return TrainerUnavailable(
            f"{who} is unavailable during {name}() ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}).{stopped} Nothing after the last checkpoint in "
            f"{self.run_dir / 'checkpoints'} is kept; run the same command again to resume from it."
        )

    def kill(self) -> None:
        """Stop every actor now (best effort: the cluster may be gone)."""
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


def start_group(
    pg: Any, placement: PlacementConfig, run_dir: str | Path, build: Callable[..., Any], args: tuple
) -> RayProcessGroup:
    """One actor in each bundle of the placement group `pg` (`len(pg.bundle_specs)` processes), joined as one
    JAX process group when there are several, each hosting `build(*args)`."""
    import ray

    from rollout.placement import in_bundle
    from rollout.ray import call_group, jax_actor_env, wait_group

    bundles = pg.bundle_specs
    n = len(bundles)
    env = jax_actor_env(gpus=bool(bundles[0].get("GPU")), cpu_devices=placement.cpu_devices_per_process)
    actors: list[Any] = [
        ray.remote(GroupProcess)
        .options(
            num_cpus=bundles[i]["CPU"],
            num_gpus=bundles[i].get("GPU", 0),  # Ray sets the process's CUDA_VISIBLE_DEVICES from it
            max_concurrency=1,
            scheduling_strategy=in_bundle(pg, i),
            runtime_env={"env_vars": env},
        )
        .remote(i, n)
        for i in range(n)
    ]
    timeout = placement.barrier_timeout_s
    group = RayProcessGroup(actors, run_dir, timeout_s=placement.call_timeout_s)
    group.processes = call_group(actors, GroupProcess.info, (), timeout, group._failure("info"))
    coordinator = ""
    if n > 1:
        coordinator = call_group(actors[:1], GroupProcess.coordinator, (), timeout, group._failure("coordinator"))[0]
    logs = [str(Path(run_dir) / "logs" / f"trainer-{i}.log") for i in range(n)]
    refs = [a.start.remote(coordinator, timeout, logs[i], build, args) for i, a in enumerate(actors)]
    wait_group(refs, timeout, group._failure("start"))
    if n > 1:
        where = ", ".join(f"{x.pid}@{x.node_ip}" for x in group.processes)
        print(f"trainer: {n} JAX processes ({where}), coordinator {coordinator}; logs in {Path(logs[0]).parent}")
    return group
