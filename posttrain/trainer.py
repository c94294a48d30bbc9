"""The on-policy trainer as a process-independent service: in this process or as a Ray actor, one typed handle.

    trainer = start_trainer(cfg, run_dir, PolicyGradientLearner, pg)   # TrainerHandle: in-process (pg None) or an actor
    metrics = trainer.train(rl_batch)               # one step of the method's learner
    trainer = start_trainer(cfg, run_dir, OnlineDPOLearner, pg)        # another method's learner
    metrics = trainer.train(pair_batch)
    trainer.sync(sampler)                           # weights: trainer -> a rollout.sampler.Sampler

The trainer is one class, `LocalTrainer`, hosting one method's
`posttrain.onpolicy.learner.PolicyLearner`, used directly (single-controller
mode, with the JAX sampler on another sub-mesh of the same process) or as a
Ray actor that owns the trainer's devices (bundle 0 of the run's placement
group, `rollout.placement`); the driver talks to either through
`TrainerHandle`, whose methods mirror `LocalTrainer`'s.

A trainer actor that dies (or a Ray cluster that goes away under it) raises
`TrainerUnavailable`: the run stops with that message, and the same command
resumes it from its last checkpoint. An error raised inside the trainer's
method comes back as itself (a `NonFiniteLoss`, a sampler's death during a
weight sync), not wrapped in Ray's `RayTaskError`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.batch import TrainBatch
from core.errors import TemperError
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.learner import LearnerFactory, TrainStats
from rollout.sampler import Sampler


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

    def sync(self, sampler: Sampler) -> dict:
        """Push the current weights (and policy version) to one sampler; returns its sync statistics."""
        from rollout.weight_sync import reshard_to_jax_sampler, sync_to_vllm

        chunk = self.cfg.rollout.reshard_chunk_bytes
        version = self.learner.version
        if sampler.remote:  # a vLLM actor: HF-named host chunks
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
        from rollout.ray import call_actor

        return call_actor(self.target, method, args, self.timeout_s, self._unavailable)

    def _unavailable(self, name: str, err: Exception) -> TrainerUnavailable:
        """The actor (or the cluster) is gone."""
        self.lost = True
        return TrainerUnavailable(
            f"the trainer actor is unavailable during {name}() ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Nothing after the last checkpoint in "
            f"{self.run_dir / 'checkpoints'} is kept; run the same command again to resume from it."
        )

    def model_config(self) -> dict:
        return self._call(LocalTrainer.model_config)

    def version(self) -> int:
        return self._call(LocalTrainer.version)

    def batch_shards(self) -> int:
        return self._call(LocalTrainer.batch_shards)

    def train(self, batch: TrainBatch) -> TrainStats:
        return self._call(LocalTrainer.train, batch)

    def sync(self, sampler: Sampler) -> dict:
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


def start_trainer(cfg: PostTrainConfig, run_dir: str | Path, learner_class: LearnerFactory, pg=None) -> TrainerHandle:
    """The trainer (hosting `learner_class`) in this process (pg None) or as a Ray actor in bundle 0 of `pg`."""
    cfg_json = cfg.model_dump(mode="json")
    if pg is None:
        fractions = (cfg.mesh.trainer_devices_fraction, cfg.mesh.sampler_devices_fraction)
        local = LocalTrainer(cfg_json, str(run_dir), learner_class, fractions)
        return TrainerHandle(local, remote=False, run_dir=run_dir)
    import ray

    from rollout.placement import in_bundle
    from rollout.ray import jax_actor_env

    env = jax_actor_env(gpus=bool(ray.cluster_resources().get("GPU")))
    actor = (
        ray.remote(LocalTrainer)
        .options(
            num_cpus=1,
            max_concurrency=1,
            scheduling_strategy=in_bundle(pg, 0),
            runtime_env={"env_vars": env},
        )
        .remote(cfg_json, str(run_dir), learner_class, None)
    )
    handle = TrainerHandle(actor, remote=True, run_dir=run_dir)
    handle.version()  # surface start-up errors here
    return handle
