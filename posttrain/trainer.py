"""The on-policy trainer as a process-independent service: in this process, or as a group of Ray actors, one typed
handle.

    trainer = start_trainer(cfg, run_dir, PolicyGradientLearner, placement)  # in-process (placement None) or actors
    metrics = trainer.train(rl_batch)               # one step of the method's learner
    trainer = start_trainer(cfg, run_dir, OnlineDPOLearner, placement)       # another method's learner
    metrics = trainer.train(pair_batch)
    trainer.sync(sampler)                           # weights: trainer -> a rollout.sampler.Sampler

The trainer is one class, `LocalTrainer`, hosting one method's `posttrain.onpolicy.learner.PolicyLearner`, used
directly (single-controller mode, with the JAX sampler on another sub-mesh of the same process) or in Ray actors
(`TrainerProcess`) that own the trainer's devices, one per bundle of the run's trainer placement group
(`rollout.placement`). With `placement.trainer_processes` > 1 the actors are one JAX process group
(`core.distributed`: `jax.distributed`, one mesh over all their devices), and the driver sends every call to every
process (SPMD: the same programs in the same order) and reads process 0's answer. The driver talks to any of these
through `TrainerHandle`, whose methods mirror `LocalTrainer`'s.

A trainer process that dies (or a Ray cluster that goes away under it) raises `TrainerUnavailable` naming the
process and its node; the group's other processes are stopped with it (they would wait in their next collective),
and the same command resumes the run from its last checkpoint. An error raised inside the trainer's method comes
back as itself (a `NonFiniteLoss`, a sampler's death during a weight sync), not wrapped in Ray's `RayTaskError`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.batch import TrainBatch
from core.errors import TemperError
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.learner import LearnerFactory, TrainStats
from rollout.sampler import Sampler
from rollout.weight_sync import SyncStats


class LocalTrainer:
    """The policy learner plus its checkpoints and weight sync; the methods the RL driver calls."""

    def __init__(
        self,
        cfg_json: dict,
        run_dir: str,
        learner_class: LearnerFactory,
        devices_fraction: tuple[float, float] | None = None,
    ):
        """`learner_class(cfg, model, mesh, total_steps)`: the method's learner."""
        import jax

        from core.checkpoint import Checkpointer, initial_model
        from core.mesh import make_mesh, split_devices

        cfg = PostTrainConfig.model_validate(cfg_json)
        fractions = devices_fraction or (cfg.mesh.trainer_devices_fraction, 0.0)
        trainer_devices, _ = split_devices(jax.devices(), *fractions)
        self.mesh = make_mesh(cfg.mesh, trainer_devices)
        model, self.cfg = initial_model(cfg, self.mesh)  # the loaded checkpoint decides the shape
        self.learner = learner_class(self.cfg, model, self.mesh, cfg.train.steps)
        c = cfg.checkpoint
        self.checkpointer = Checkpointer(Path(run_dir) / "checkpoints", keep=c.keep, async_save=c.async_save)

    # the driver's calls ---------------------------------------------------

    def model_config(self) -> dict:
        return self.cfg.model.model_dump(mode="json")

    def version(self) -> int:
        return self.learner.version

    def batch_shards(self) -> int:
        return self.learner.batch_shards()

    def train(self, batch: TrainBatch) -> TrainStats:
        return self.learner.train(batch)

    def sync(self, sampler: Sampler, tag: str = "") -> SyncStats:
        """Push the current weights (and policy version) to one sampler; returns this process's sync statistics.
        `tag` names the update (the same on every process of a group: their pieces make one update)."""
        from rollout.weight_sync import reshard_to_jax_sampler, sync_to_vllm

        chunk = self.cfg.rollout.reshard_chunk_bytes
        version = self.learner.version
        if sampler.remote:  # a vLLM actor: every process sends the pieces its devices hold
            return sync_to_vllm(self.learner.params, self.cfg.model, sampler, chunk, version=version, tag=tag or None)
        return reshard_to_jax_sampler(self.learner.params, sampler, chunk, version=version)

    def save(self, step: int, extra: dict) -> None:
        self.learner.save(self.checkpointer, step, extra)

    def restore_latest(self) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (corrupt ones skipped), or None."""
        return self.learner.restore_latest(self.checkpointer)

    def export_hf(self, path: str, tokenizer_dir: str | None) -> str:
        self.checkpointer.wait()
        return str(self.learner.export_hf(path, tokenizer_dir))

    def close(self) -> None:
        self.checkpointer.close()


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


class TrainerProcess:
    """One process of the trainer, as a Ray actor: it joins the JAX process group, then hosts a `LocalTrainer` and
    runs the driver's calls on it."""

    def __init__(self, rank: int, processes: int):
        self.rank, self.processes = rank, processes
        self.trainer: LocalTrainer | None = None

    def info(self) -> ProcessInfo:
        import os

        import ray

        ctx = ray.get_runtime_context()
        return ProcessInfo(self.rank, self.processes, ray.util.get_node_ip_address(), ctx.get_node_id(), os.getpid())

    def coordinator(self) -> str:
        """Where the group's coordinator will listen: this node's address and a free port (asked of process 0)."""
        import ray

        from core.distributed import free_port

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def start(
        self, coordinator: str, timeout_s: int, cfg_json: dict, run_dir: str, learner_class: LearnerFactory
    ) -> None:
        """Join the group (before JAX looks at a device), then build the trainer on the group's devices."""
        from core.distributed import ProcessGroup, join

        join(ProcessGroup(coordinator, self.processes, self.rank, timeout_s))
        self.trainer = LocalTrainer(cfg_json, run_dir, learner_class, None)

    def call(self, method: Callable, args: tuple) -> Any:
        """`method` (one of `LocalTrainer`'s) on this process's trainer."""
        assert self.trainer is not None, "start() first"
        return method(self.trainer, *args)


class TrainerHandle:
    """The driver's view of the trainer: `LocalTrainer`'s methods, run in this process or on every process of its
    Ray actor group, whose process 0 answers (each remote call with a timeout)."""

    def __init__(
        self,
        run_dir: str | Path,
        local: LocalTrainer | None = None,
        actors: Sequence[Any] = (),
        timeout_s: float = 3600.0,
    ):
        self.run_dir, self.local_trainer, self.actors, self.timeout_s = Path(run_dir), local, list(actors), timeout_s
        self.remote = local is None
        self.processes: list[ProcessInfo] = []  # where each actor runs, once started
        self.lost = False  # set once a call found an actor (or its cluster) gone

    def _call(self, method: Callable, *args: Any) -> Any:
        """`method` on the trainer: in this process, or on every process of the group (process 0's answer)."""
        if self.local_trainer is not None:
            return method(self.local_trainer, *args)
        return self._call_all(method, *args)[0]

    def _call_all(self, method: Callable, *args: Any) -> list:
        """`method` on every process of the group, their answers in process order."""
        from rollout.ray import call_group

        name = method.__name__
        return call_group(
            self.actors, TrainerProcess.call, (method, args), self.timeout_s, lambda e, i: self._unavailable(name, e, i)
        )

    def _unavailable(self, name: str, err: Exception, rank: int) -> TrainerUnavailable:
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
        """Stop every trainer actor now (best effort: the cluster may be gone)."""
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def model_config(self) -> dict:
        return self._call(LocalTrainer.model_config)

    def version(self) -> int:
        return self._call(LocalTrainer.version)

    def batch_shards(self) -> int:
        return self._call(LocalTrainer.batch_shards)

    def train(self, batch: TrainBatch) -> TrainStats:
        return self._call(LocalTrainer.train, batch)

    def sync(self, sampler: Sampler) -> SyncStats:
        """The weights into `sampler`, from every trainer process (each sends what its devices hold): bytes and
        chunks summed over the processes, the time of the slowest."""
        if self.local_trainer is not None:
            return self.local_trainer.sync(sampler)
        parts = self._call_all(LocalTrainer.sync, sampler, uuid.uuid4().hex)
        stats = SyncStats.combine(parts)
        if len(parts) > 1:
            print(f"{stats.line()} from {len(parts)} trainer processes", flush=True)
        return stats

    def save(self, step: int, extra: dict) -> None:
        self._call(LocalTrainer.save, step, extra)

    def restore_latest(self) -> tuple[int, dict] | None:
        return self._call(LocalTrainer.restore_latest)

    def export_hf(self, path: str, tokenizer_dir: str | None) -> str:
        return self._call(LocalTrainer.export_hf, path, tokenizer_dir)

    def close(self) -> None:
        self._call(LocalTrainer.close)

    def local(self) -> LocalTrainer:
        """The in-process trainer (single-controller mode only)."""
        if self.local_trainer is None:
            raise RuntimeError("the trainer runs in Ray actors, not in this process")
        return self.local_trainer


def start_trainer(cfg: PostTrainConfig, run_dir: str | Path, learner_class: LearnerFactory, placement=None):
    """The trainer (hosting `learner_class`) in this process (`placement` None), or as `placement.trainer_processes`
    Ray actors, one in each bundle of `placement.trainer` (a `rollout.placement.Placement`), joined as one JAX
    process group when there are several."""
    cfg_json = cfg.model_dump(mode="json")
    if placement is None:
        fractions = (cfg.mesh.trainer_devices_fraction, cfg.mesh.sampler_devices_fraction)
        local = LocalTrainer(cfg_json, str(run_dir), learner_class, fractions)
        return TrainerHandle(run_dir, local=local)
    import ray

    from rollout.placement import in_bundle
    from rollout.ray import call_group, jax_actor_env

    n, p = cfg.placement.trainer_processes, cfg.placement
    bundles = placement.trainer.bundle_specs
    env = jax_actor_env(gpus=bool(bundles[0].get("GPU")), cpu_devices=p.cpu_devices_per_process)
    actors = [
        ray.remote(TrainerProcess)
        .options(
            num_cpus=bundles[i]["CPU"],
            num_gpus=bundles[i].get("GPU", 0),  # Ray sets the process's CUDA_VISIBLE_DEVICES from it
            max_concurrency=1,
            scheduling_strategy=in_bundle(placement.trainer, i),
            runtime_env={"env_vars": env},
        )
        .remote(i, n)
        for i in range(n)
    ]
    handle = TrainerHandle(run_dir, actors=actors)
    starting = lambda what: lambda e, i: handle._unavailable(what, e, i)
    handle.processes = call_group(actors, TrainerProcess.info, (), p.barrier_timeout_s, starting("info"))
    coordinator = ""
    if n > 1:
        ask = (actors[0],)
        coordinator = call_group(ask, TrainerProcess.coordinator, (), p.barrier_timeout_s, starting("coordinator"))[0]
    call_group(
        actors,
        TrainerProcess.start,
        (coordinator, p.barrier_timeout_s, cfg_json, str(run_dir), learner_class),
        p.barrier_timeout_s,
        starting("start"),
    )
    if n > 1:
        where = ", ".join(f"{x.pid}@{x.node_ip}" for x in handle.processes)
        print(f"trainer: {n} JAX processes ({where}), coordinator {coordinator}", flush=True)
    return handle
