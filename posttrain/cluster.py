"""Where the RL pieces run: the trainer (in this process or a Ray actor), vLLM sampler actors, placement.

    trainer = start_trainer(cfg, run_dir, remote=True)    # TrainerClient over a Ray actor
    samplers = start_vllm_samplers(cfg, hf_dir, placement) # RemoteVLLMSampler actors
    trainer.call("sync", samplers)                         # weights: trainer actor -> sampler actors

The trainer is one class, `LocalTrainer`, used directly (single-controller
mode, with the JAX sampler on another sub-mesh of the same process) or as a
Ray actor that owns the trainer's devices. A placement group reserves the
trainer's and every sampler's resources up front, so a run that cannot fit
fails at start with the numbers, not halfway through.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from core.config import Config


def load_policy(cfg: Config, mesh):
    """The starting policy on `mesh`: `rl.policy_path` (HF or Temper checkpoint) or a random init."""
    from core.checkpoint import load_model_from
    from core.models import create_model

    if cfg.rl.policy_path is None:
        return create_model(cfg.model, mesh, seed=cfg.run.seed)
    try:
        return load_model_from(cfg.rl.policy_path, mesh, dtype=cfg.model.param_dtype)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"rl.policy_path: {e}") from e


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

    def sync(self, samplers: list, version: int | None = None) -> list[dict]:
        """Push the current weights to every sampler; returns one stats dict per sampler."""
        from rollout.weight_sync import reshard_to_jax_sampler, sync_to_vllm

        version = self.learner.version if version is None else version
        chunk = self.cfg.rollout.reshard_chunk_bytes
        out = []
        for sampler in samplers:
            if hasattr(sampler, "generate_async"):  # vLLM actor
                stats = sync_to_vllm(self.learner.params, self.cfg.model, sampler, chunk, version=version)
            else:
                stats = reshard_to_jax_sampler(self.learner.params, sampler, chunk, version=version)
            out.append({"version": stats.version, "bytes": stats.bytes, "seconds": stats.seconds})
        return out

    def latest_step(self) -> int | None:
        return self.checkpointer.latest_step()

    def save(self, step: int, extra: dict) -> None:
        self.learner.save(self.checkpointer, step, extra)

    def restore(self, step: int) -> dict:
        return self.learner.restore(self.checkpointer, step)

    def export_hf(self, path: str, tokenizer_dir: str | None) -> str:
        self.checkpointer.wait()
        return str(self.learner.export_hf(path, tokenizer_dir))

    def close(self) -> None:
        self.checkpointer.close()


class TrainerClient:
    """Calls `LocalTrainer` methods, in-process or on its Ray actor (with a timeout)."""

    def __init__(self, target: Any, remote: bool, timeout_s: float = 3600.0):
        self.target, self.remote, self.timeout_s = target, remote, timeout_s

    def call(self, method: str, *args, **kwargs):
        if not self.remote:
            return getattr(self.target, method)(*args, **kwargs)
        import ray

        return ray.get(getattr(self.target, method).remote(*args, **kwargs), timeout=self.timeout_s)


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
            raise ValueError(f"cannot place a trainer on {trainer} GPU(s) and {k} sampler(s) on {gpus} GPUs "
                             f"(mesh.trainer_devices_fraction={cfg.mesh.trainer_devices_fraction}, "
                             f"mesh.sampler_devices_fraction={cfg.mesh.sampler_devices_fraction})")
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
        raise RuntimeError(f"Ray could not reserve {bundles} within {timeout_s:.0f}s; "
                           f"cluster resources: {ray.cluster_resources()}") from e
    return pg


def in_bundle(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def start_trainer(cfg: Config, run_dir: str | Path, pg=None) -> TrainerClient:
    """The trainer in this process (pg None) or as a Ray actor in bundle 0 of `pg`."""
    cfg_json = cfg.model_dump(mode="json")
    if pg is None:
        fractions = (cfg.mesh.trainer_devices_fraction, cfg.mesh.sampler_devices_fraction)
        return TrainerClient(LocalTrainer(cfg_json, str(run_dir), fractions), remote=False)
    import ray

    from core.host_memory import malloc_tunables

    env = {k: v for k, v in os.environ.items() if k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64")}
    env.setdefault("JAX_PLATFORMS", "cpu" if not ray.cluster_resources().get("GPU") else "")
    env["GLIBC_TUNABLES"] = malloc_tunables()
    actor = ray.remote(LocalTrainer).options(
        num_cpus=1, max_concurrency=1, scheduling_strategy=in_bundle(pg, 0),
        runtime_env={"env_vars": env},
    ).remote(cfg_json, str(run_dir))
    client = TrainerClient(actor, remote=True)
    client.call("version")  # surface start-up errors here
    return client


def start_vllm_sampler(cfg: Config, hf_dir: str, index: int, pg=None):
    from rollout.vllm_actor import RemoteVLLMSampler

    bundle = pg.bundle_specs[1 + index] if pg is not None else {"CPU": 0}  # what `reserve` reserved
    return RemoteVLLMSampler.start(
        hf_dir, cfg.rollout, seed=cfg.run.seed + index, num_cpus=bundle["CPU"],
        timeout_s=cfg.rollout.sampler_timeout_s,
        scheduling_strategy=in_bundle(pg, 1 + index) if pg is not None else None,
    )

