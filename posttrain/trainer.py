"""The on-policy trainer as a process-independent service: in this process, or as a group of Ray actors, one typed
handle.

    trainer = start_trainer(cfg, run_dir, GRPO, placement)  # in-process (placement None) or actors
    stats = trainer.train(rl_batch)                 # one step of the method (core.method_learner.MethodLearner)
    trainer = start_trainer(cfg, run_dir, ONLINE_DPO, placement)       # another method
    stats = trainer.train(pair_batch)
    trainer.sync(sampler)                           # weights: trainer -> a rollout.sampler.Sampler

The trainer is one class, `LocalTrainer`, hosting one method's `core.method_learner.MethodLearner`, used
directly (single-controller mode, with the JAX sampler on another sub-mesh of the same process) or in Ray actors
that own the trainer's devices, one per bundle of the run's trainer placement group (`rollout.placement`). With
`placement.trainer_processes` > 1 the actors are one JAX process group (`posttrain.process_group`: `jax.distributed`,
one mesh over all their devices), and the driver sends every call to every process (SPMD: the same programs in the
same order) and reads process 0's answer; a weight sync takes every process's part (each sends the pieces its
devices hold). The driver talks to any of these through `TrainerHandle`, whose methods mirror `LocalTrainer`'s.

A trainer process that dies (or a Ray cluster that goes away under it) raises `TrainerUnavailable` naming the
process and its node; the group's other processes are stopped with it (they would wait in their next collective),
and the same command resumes the run from its last checkpoint. An error raised inside the trainer's method comes
back as itself (a `NonFiniteLoss`, a sampler's death during a weight sync), not wrapped in Ray's `RayTaskError`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.batch import TrainBatch
from core.compile_cache import CompileTally, compile_clock, use_compile_cache
from core.method import Method, TrainStats
from posttrain.config import PostTrainConfig
from posttrain.process_group import ProcessInfo, RayProcessGroup, TrainerUnavailable, start_group
from rollout.sampler import Sampler
from rollout.weight_sync import SyncStats

__all__ = ["LocalTrainer", "TrainerHandle", "TrainerUnavailable", "start_trainer"]


class LocalTrainer:
    """The method's learner plus its checkpoints and weight sync; the methods the RL driver calls."""

    def __init__(
        self,
        cfg_json: dict,
        run_dir: str,
        method: Method,
        devices_fraction: tuple[float, float] | None = None,
    ):
        import jax

        from core.checkpoint import Checkpointer
        from core.checkpoint_models import initial_model
        from core.hf.peft import adapter_base
        from core.mesh import make_mesh, split_devices
        from core.method_learner import MethodLearner

        cfg = PostTrainConfig.model_validate(cfg_json)
        use_compile_cache(cfg.compile.cache_dir)  # an actor's process: the driver's setting does not reach it
        self._clock_start = compile_clock().read()
        fractions = devices_fraction or (cfg.mesh.trainer_devices_fraction, 0.0)
        trainer_devices, _ = split_devices(jax.devices(), *fractions)
        self.mesh = make_mesh(cfg.mesh, trainer_devices)
        model, self.cfg = initial_model(cfg, self.mesh)  # the loaded checkpoint decides the shape
        self.learner = MethodLearner(self.cfg, method, model, self.mesh)
        self.adapter_base = adapter_base(cfg.checkpoint.init_from)  # what synced adapters name as their base
        c = cfg.checkpoint
        self.checkpointer = Checkpointer(Path(run_dir) / "checkpoints", keep=c.keep, async_save=c.async_save)

    # the driver's calls ---------------------------------------------------

    def model_config(self) -> dict:
        return self.cfg.model.model_dump(mode="json")

    def version(self) -> int:
        return self.learner.version

    def batch_shards(self) -> int:
        return self.learner.batch_shards()

    def compiled(self) -> CompileTally:
        """What this trainer's process compiled since the trainer started (its start-up included)."""
        return compile_clock().read() - self._clock_start

    def train(self, batch: TrainBatch) -> TrainStats:
        before = compile_clock().read()
        stats = self.learner.train(batch)
        return dataclasses.replace(stats, compile=compile_clock().read() - before)

    def sync(self, sampler: Sampler, tag: str = "") -> SyncStats:
        """Push the current weights (and policy version) to one sampler; returns this process's sync statistics.
        `tag` names the update (the same on every process of a group: their pieces make one update)."""
        from rollout.weight_sync import sync_policy

        r = self.cfg.rollout
        model = self.learner.model()
        return sync_policy(
            model, sampler, r.reshard_chunk_bytes, self.learner.version, r.lora_sync, self.adapter_base, tag
        )

    def sampler_start(self, path: str, tokenizer_dir: str | None) -> str:
        """What a vLLM sampler starts from, as a Hugging Face directory at `path`: the policy (merged), or, when
        it syncs LoRA adapters alone, their base (dequantized, with a QLoRA base)."""
        from core.hf.directory import save_hf
        from core.models.adapters import adapters_off

        self.checkpointer.wait()
        model = self.learner.model()
        if model.cfg.lora is not None and self.cfg.rollout.lora_sync == "adapters":
            return str(save_hf(adapters_off(model), model.cfg, path, tokenizer_dir=tokenizer_dir))
        return str(self.learner.export_hf(path, tokenizer_dir))

    def save(self, step: int, extra: dict) -> None:
        self.learner.save(self.checkpointer, step, extra)

    def restore_latest(self) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores whole (corrupt ones skipped), or None."""
        return self.learner.restore_latest(self.checkpointer)

    def export_hf(self, path: str, tokenizer_dir: str | None) -> str:
        """The run's export: the policy at `path` and what its method exports beside it."""
        self.checkpointer.wait()
        return str(self.learner.export(path, tokenizer_dir))

    def close(self) -> None:
        self.checkpointer.close()


class TrainerHandle:
    """The driver's view of the trainer: `LocalTrainer`'s methods, run in this process or on every process of its
    Ray actor group (`posttrain.process_group`), whose process 0 answers (each remote call with a timeout)."""

    def __init__(self, run_dir: str | Path, local: LocalTrainer | None = None, group: RayProcessGroup | None = None):
        self.run_dir, self.local_trainer, self.group = Path(run_dir), local, group
        self.remote = local is None

    @property
    def actors(self) -> list:
        """The trainer's Ray actors, one a process (none in this process's mode)."""
        return self.group.actors if self.group is not None else []

    @property
    def processes(self) -> list[ProcessInfo]:
        return self.group.processes if self.group is not None else []

    @property
    def lost(self) -> bool:
        """Whether a call found a trainer process (or its cluster) gone."""
        return self.group is not None and self.group.lost

    def _call(self, method: Callable, *args: Any) -> Any:
        """`method` on the trainer: in this process, or on every process of the group (process 0's answer)."""
        if self.local_trainer is not None:
            return method(self.local_trainer, *args)
        assert self.group is not None
        return self.group.call(method, *args)

    def kill(self) -> None:
        """Stop every trainer actor now (best effort: the cluster may be gone)."""
        if self.group is not None:
            self.group.kill()

    def model_config(self) -> dict:
        return self._call(LocalTrainer.model_config)

    def version(self) -> int:
        return self._call(LocalTrainer.version)

    def batch_shards(self) -> int:
        return self._call(LocalTrainer.batch_shards)

    def train(self, batch: TrainBatch) -> TrainStats:
        return self._call(LocalTrainer.train, batch)

    def compiled(self) -> CompileTally:
        return self._call(LocalTrainer.compiled)

    def sync(self, sampler: Sampler) -> SyncStats:
        """The weights into `sampler`, from every trainer process (each sends what its devices hold): bytes and
        chunks summed over the processes, the time of the slowest."""
        if self.local_trainer is not None:
            return self.local_trainer.sync(sampler)
        assert self.group is not None
        parts = self.group.call_all(LocalTrainer.sync, sampler, uuid.uuid4().hex)
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

    def sampler_start(self, path: str, tokenizer_dir: str | None) -> str:
        return self._call(LocalTrainer.sampler_start, path, tokenizer_dir)

    def close(self) -> None:
        self._call(LocalTrainer.close)

    def local(self) -> LocalTrainer:
        """The in-process trainer (single-controller mode only)."""
        if self.local_trainer is None:
            raise RuntimeError("the trainer runs in Ray actors, not in this process")
        return self.local_trainer


def start_trainer(cfg: PostTrainConfig, run_dir: str | Path, method: Method, placement=None):
    """The trainer (hosting `method`'s learner) in this process (`placement` None), or as `placement.trainer_processes`
    Ray actors, one in each bundle of `placement.trainer` (a `rollout.placement.Placement`), joined as one JAX
    process group when there are several."""
    cfg_json = cfg.model_dump(mode="json")
    if placement is None:
        fractions = (cfg.mesh.trainer_devices_fraction, cfg.mesh.sampler_devices_fraction)
        local = LocalTrainer(cfg_json, str(run_dir), method, fractions)
        return TrainerHandle(run_dir, local=local)
    args = (cfg_json, str(run_dir), method, None)
    return TrainerHandle(run_dir, group=start_group(placement.trainer, cfg.placement, run_dir, LocalTrainer, args))
