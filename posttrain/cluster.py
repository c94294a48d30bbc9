"""Where the RL pieces run: the trainer (in this process or a Ray actor), vLLM sampler actors, placement.

    trainer = start_trainer(cfg, run_dir, pg)               # TrainerHandle: in-process or a Ray actor
    sampler = start_vllm_sampler(cfg, hf_dir, 0, pg)         # a RemoteVLLMSampler actor
    trainer.sync(sampler)                                     # weights: trainer (actor) -> sampler (actor)

The trainer is one class, `LocalTrainer`, used directly (single-controller
mode, with the JAX sampler on another sub-mesh of the same process) or as a
Ray actor that owns the trainer's devices; the driver talks to either through
`TrainerHandle`, whose methods mirror `LocalTrainer`'s. A placement group
reserves the trainer's and every sampler's resources up front, so a run that
cannot fit fails at start with the numbers, not halfway through.

A trainer actor that dies (or a Ray cluster that goes away under it) raises
`TrainerUnavailable`: the run stops with that message, and the same command
resumes it from its last checkpoint. An error raised inside the trainer's
method comes back as itself (a `NonFiniteLoss`, a sampler's death during a
weight sync), not wrapped in Ray's `RayTaskError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config import Config
from core.errors import MissingPath, TemperError


def load_policy(cfg: Config, mesh):
    """The starting policy on `mesh`: `rl.policy_path` (HF or Temper checkpoint) or a random init."""
    from core.checkpoint import load_model_from
    from core.models import create_model

    if cfg.rl.policy_path is None:
        return create_model(cfg.model, mesh, seed=cfg.run.seed)
    try:
        return load_model_from(cfg.rl.policy_path, mesh, dtype=cfg.model.param_dtype)
    except MissingPath as e:
        raise MissingPath(f"rl.policy_path: {e}") from None


class LocalTrainer:
    """The policy learner plus its checkpoints and weight sync; the methods the RL driver calls."""

    def __init__(self, cfg_json: dict, run_dir: str, devices_fraction: tuple[float, float] | None = None):
        import jax

        from core.checkpoint import Checkpointer
        from core.mesh import make_mesh, split_devices
        from posttrain.learner import PolicyLearner

        cfg = Config.model_validate(cfg_json)
        fractions = devices_fraction or (cfg.mesh.trainer_devices_fraction, 0.0)
        trainer_devices, _ = split_devices(jax.devices(), *fractions)
        self.mesh = make_mesh(cfg.mesh, trainer_devices)
        with jax.set_mesh(self.mesh):
            model = load_policy(cfg, self.mesh)
        self.cfg = cfg.model_copy(update={"model": model.cfg})  # the loaded checkpoint decides the shape
        self.learner = PolicyLearner(self.cfg, model, self.mesh, cfg.train.steps)
        c = cfg.checkpoint
        self.checkpointer = Checkpointer(Path(run_dir) / "checkpoints", keep=c.keep, async_save=c.async_save)

    # the driver's calls ---------------------------------------------------

    def model_config(self) -> dict:
        return self.cfg.model.model_dump(mode="json")

    def version(self) -> int:
        return self.learner.version

    def batch_shards(self) -> int:
        return self.learner.batch_shards()

    def train(self, batch: dict) -> dict:
        return self.learner.train(batch)

    def sync(self, sampler: Any) -> dict:
        """Push the current weights (and policy version) to one sampler; returns its sync statistics."""
        from rollout.weight_sync import reshard_to_jax_sampler, sync_to_vllm

        chunk = self.cfg.rollout.reshard_chunk_bytes
        version = self.learner.version
        if hasattr(sampler, "generate_async"):  # vLLM actor
            stats = sync_to_vllm(self.learner.params, self.cfg.model, sampler, chunk, version=version)
        else:
            stats = reshard_to_jax_sampler(self.learner.params, sampler, chunk, version=version)
        return {"version": stats.version, "bytes": stats.bytes, "seconds": stats.seconds}

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
    """The trainer actor died, or the Ray cluster it ran on went away; the run resumes from its last checkpoint."""


class TrainerHandle:
    """The driver's view of the trainer: `LocalTrainer`'s methods, run in this process or on its Ray actor
    (each remote call with a timeout)."""

    def __init__(self, target: Any, remote: bool, run_dir: str | Path, timeout_s: float = 3600.0):
        self.target, self.remote, self.run_dir, self.timeout_s = target, remote, Path(run_dir), timeout_s
        self.lost = False  # set once a call found the actor (or its cluster) gone

    def _call(self, method: Callable, *args: Any) -> Any:
        if not self.remote:
            return method(self.target, *args)
        import ray

        try:
            return ray.get(getattr(self.target, method.__name__).remote(*args), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as err:  # the method raised inside a live actor: its own error
            raise err.cause from None
        except (ray.exceptions.RayError, ConnectionError) as err:  # the actor (or the cluster) is gone
            self.lost = True
            raise TrainerUnavailable(
                f"the trainer actor is unavailable during {method.__name__}() ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}). Nothing after the last checkpoint in "
                f"{self.run_dir / 'checkpoints'} is kept; run the same command again to resume from it."
            ) from None

    def model_config(self) -> dict:
        return self._call(LocalTrainer.model_config)

    def version(self) -> int:
        return self._call(LocalTrainer.version)

    def batch_shards(self) -> int:
        return self._call(LocalTrainer.batch_shards)

    def train(self, batch: dict) -> dict:
        return self._call(LocalTrainer.train, batch)

    def sync(self, sampler: Any) -> dict:
        return self._call(LocalTrainer.sync, sampler)

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
        if self.remote:
            raise RuntimeError("the trainer runs in a Ray actor, not in this process")
        return self.target


# ------------------------------------------------------------------ placement


def placement_bundles(cfg: Config, resources: dict[str, float]) -> list[dict[str, float]]:
    """Bundle 0: the trainer; then one per vLLM sampler (`rollout.rollout_data_parallelism`).

    With GPUs the split follows `mesh.trainer_devices_fraction` /
    `sampler_devices_fraction`; on CPU the trainer gets one CPU and the
    samplers share the rest (vLLM's CPU threads are bound separately).
    """
    k = cfg.rollout.rollout_data_parallelism
    gpus = int(resources.get("GPU", 0))
    if gpus:
        trainer = max(1, round(cfg.mesh.trainer_devices_fraction * gpus))
        per_sampler = (cfg.mesh.sampler_devices_fraction * gpus or gpus - trainer) / k
        if per_sampler < 1 or trainer + k * int(per_sampler) > gpus:
            raise ValueError(
                f"cannot place a trainer on {trainer} GPU(s) and {k} sampler(s) on {gpus} GPUs "
                f"(mesh.trainer_devices_fraction={cfg.mesh.trainer_devices_fraction}, "
                f"mesh.sampler_devices_fraction={cfg.mesh.sampler_devices_fraction})"
            )
        return [{"CPU": 1, "GPU": trainer}] + [{"CPU": 1, "GPU": int(per_sampler)}] * k
    cpus = resources.get("CPU", 1)
    share = max(0.01, min(1.0, (cpus - 1) / k))
    return [{"CPU": 1.0}] + [{"CPU": round(share, 2)}] * k


def reserve(cfg: Config, timeout_s: float = 120.0):
    """A ready placement group for the run (raises with the numbers if the cluster cannot hold it)."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = placement_bundles(cfg, ray.cluster_resources())
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RuntimeError(
            f"Ray could not reserve {bundles} within {timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
        ) from e
    return pg


def in_bundle(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def start_trainer(cfg: Config, run_dir: str | Path, pg=None) -> TrainerHandle:
    """The trainer in this process (pg None) or as a Ray actor in bundle 0 of `pg`."""
    cfg_json = cfg.model_dump(mode="json")
    if pg is None:
        fractions = (cfg.mesh.trainer_devices_fraction, cfg.mesh.sampler_devices_fraction)
        return TrainerHandle(LocalTrainer(cfg_json, str(run_dir), fractions), remote=False, run_dir=run_dir)
    import ray

    from core.host_memory import malloc_tunables

    env = {k: v for k, v in os.environ.items() if k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64")}
    env.setdefault("JAX_PLATFORMS", "cpu" if not ray.cluster_resources().get("GPU") else "")
    env["GLIBC_TUNABLES"] = malloc_tunables()
    actor = (
        ray.remote(LocalTrainer)
        .options(
            num_cpus=1,
            max_concurrency=1,
            scheduling_strategy=in_bundle(pg, 0),
            runtime_env={"env_vars": env},
        )
        .remote(cfg_json, str(run_dir))
    )
    handle = TrainerHandle(actor, remote=True, run_dir=run_dir)
    handle.version()  # surface start-up errors here
    return handle


def start_vllm_sampler(cfg: Config, hf_dir: str, index: int, pg=None):
    from rollout.vllm_actor import RemoteVLLMSampler

    bundle = pg.bundle_specs[1 + index] if pg is not None else {"CPU": 0}  # what `reserve` reserved
    return RemoteVLLMSampler.start(
        hf_dir,
        cfg.rollout,
        seed=cfg.run.seed + index,
        num_cpus=bundle["CPU"],
        timeout_s=cfg.rollout.sampler_timeout_s,
        scheduling_strategy=in_bundle(pg, 1 + index) if pg is not None else None,
    )
