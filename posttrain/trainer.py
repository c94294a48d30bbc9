"""Every method's trainer as a process-independent service: in this process, or as a group of Ray actors, one typed
handle.

    trainer = start_trainer(cfg, run_dir, GRPO, placement)  # in-process (placement None) or actors
    stats = trainer.train(rl_batch)                 # one step of the method (core.method_learner.MethodLearner)
    trainer = start_trainer(cfg, run_dir, ONLINE_DPO, placement)       # another method
    stats = trainer.train(pair_batch)
    trainer.sync(sampler)                           # weights: trainer -> a rollout.sampler.Sampler

The trainer is one class, `LocalTrainer` (a `core.trainer.Trainer`), hosting one method's
`core.method_learner.MethodLearner`, used directly (single-controller mode, with the JAX sampler on another sub-mesh
of the same process; an in-process dataset run uses a `core.trainer.Trainer` itself) or in Ray actors that own the
trainer's devices, one per bundle of the run's trainer placement group (`rollout.placement`). With
`placement.trainer_processes` > 1 the actors are one JAX process group (`posttrain.process_group`:
`jax.distributed`, one mesh over all their devices), and the driver sends every call to every process (SPMD: the
same programs in the same order) and reads process 0's answer; a weight sync takes every process's part (each sends
the pieces its devices hold). The driver talks to any of these through `TrainerHandle`, whose methods mirror
`LocalTrainer`'s.

A trainer process that dies (or a Ray cluster that goes away under it) raises `TrainerUnavailable` naming the
process and its node; the group's other processes are stopped with it (they would wait in their next collective),
and the same command resumes the run from its last checkpoint. An error raised inside the trainer's method comes
back as itself (a `NonFiniteLoss`, a sampler's death during a weight sync), not wrapped in Ray's `RayTaskError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.batch import TrainBatch
from core.compile_cache import CompileTally, use_compile_cache
from core.method import Method, TrainStats
from core.train import LossOutput
from core.trainer import Position, Trainer, TrainerFacts, initial_state
from posttrain.config import PostTrainConfig
from posttrain.process_group import ProcessInfo, RayProcessGroup, TrainerUnavailable, start_group
from rollout.sampler import Sampler
from rollout.weight_sync import SyncStats

__all__ = ["LocalTrainer", "TrainerHandle", "TrainerUnavailable", "start_trainer"]


class LocalTrainer(Trainer):
    """A `core.trainer.Trainer` built from the run's config in the process that hosts it (this one, or a Ray
    actor of the group), with what an on-policy run adds: the weight sync to a sampler and the directory a vLLM
    sampler starts from."""

    def __init__(
        self,
        cfg_json: Any,  # the run's config, or its JSON (an on-policy run sends that)
        run_dir: str,
        method: Method,
        devices_fraction: tuple[float, float] | None = None,
    ):
        import jax

        from core.hf.peft import adapter_base
        from core.mesh import split_devices

        cfg = PostTrainConfig.model_validate(cfg_json) if isinstance(cfg_json, dict) else cfg_json
        use_compile_cache(cfg.compile.cache_dir)  # an actor's process: the driver's setting does not reach it
        fractions = devices_fraction or (cfg.mesh.trainer_devices_fraction, 0.0)
        trainer_devices, _ = split_devices(jax.devices(), *fractions)
        mesh, model, cfg = initial_state(cfg, trainer_devices)  # the loaded checkpoint decides the shape
        super().__init__(cfg, method, model, mesh, run_dir)
        self.adapter_base = adapter_base(cfg.checkpoint.init_from)  # what synced adapters name as their base

    # the driver's calls ---------------------------------------------------

    def model_config(self) -> dict:
        return self.cfg.model.model_dump(mode="json")

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

        self.wait()
        model = self.learner.model()
        if model.cfg.lora is not None and self.cfg.rollout.lora_sync == "adapters":
            return str(save_hf(adapters_off(model), model.cfg, path, tokenizer_dir=tokenizer_dir))
        return str(self.learner.export_hf(path, tokenizer_dir))


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

    def _call(self, method: Callable, *args: Any, timeout_s: float | None = None) -> Any:
        """`method` on the trainer: in this process, or on every process of the group (process 0's answer, within
        `timeout_s`: default `placement.call_timeout_s`)."""
        if self.local_trainer is not None:
            return method(self.local_trainer, *args)
        assert self.group is not None
        return self.group.call(method, *args, timeout_s=timeout_s)

    def kill(self) -> None:
        """Stop every trainer actor now (best effort: the cluster may be gone)."""
        if self.group is not None:
            self.group.kill()

    def model_config(self) -> dict:
        return self._call(LocalTrainer.model_config)

    def facts(self) -> TrainerFacts:
        return self._call(LocalTrainer.facts)

    def version(self) -> int:
        return self._call(LocalTrainer.version)

    def batch_shards(self) -> int:
        return self._call(LocalTrainer.batch_shards)

    def memory_analysis(self) -> str | None:
        return self._call(LocalTrainer.memory_analysis)

    def train(self, batch: TrainBatch, step: int | None = None) -> TrainStats:
        return self._call(LocalTrainer.train, batch, step)

    def evaluate(self, batch: Any) -> LossOutput:
        return self._call(LocalTrainer.evaluate, batch)

    def apply(self, fn: Callable, *args: Any, timeout_s: float | None = None) -> Any:
        """`fn(trainer, *args)` on the trainer: every process of a group runs it; process 0's answer, within
        `timeout_s` (default `placement.call_timeout_s`: a long pass over a dataset says how long it may take)."""
        return self._call(LocalTrainer.apply, fn, *args, timeout_s=timeout_s)

    def device_memory(self) -> str:
        return self._call(LocalTrainer.device_memory)

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

    def save(self, step: int, extra: dict, data_iterator: Any = None) -> None:
        """A checkpoint at `step`; a data iterator of this process is saved as its position (a `Position`: every
        trainer process writes it beside its shards)."""
        remote = self.local_trainer is None and data_iterator is not None
        self._call(LocalTrainer.save, step, extra, Position.of(data_iterator) if remote else data_iterator)

    def restore_latest(self, data_iterator: Any = None) -> tuple[int, dict] | None:
        """(step, meta) of the newest checkpoint that restores, or None; the data's position into `data_iterator`
        (this process's), from process 0's copy."""
        if self.local_trainer is not None or data_iterator is None:
            return self._call(LocalTrainer.restore_latest, data_iterator)
        restored = self._call(_restore_with_position)
        if restored is None:
            return None
        step, meta, position = restored
        data_iterator.set_state(position)
        return step, meta

    def latest_step(self) -> int | None:
        return self._call(LocalTrainer.latest_step)

    def wait(self) -> None:
        self._call(LocalTrainer.wait)

    def export(self, path: str, tokenizer_dir: str | None) -> str:
        return self._call(LocalTrainer.export, path, tokenizer_dir)

    def sampler_start(self, path: str, tokenizer_dir: str | None) -> str:
        return self._call(LocalTrainer.sampler_start, path, tokenizer_dir)

    def close(self) -> None:
        self._call(LocalTrainer.close)

    def local(self) -> LocalTrainer:
        """The in-process trainer (single-controller mode only)."""
        if self.local_trainer is None:
            raise RuntimeError("the trainer runs in Ray actors, not in this process")
        return self.local_trainer


def _restore_with_position(trainer: LocalTrainer) -> tuple[int, dict, Any] | None:
    """`restore_latest` in a trainer process, with the data's position it read (for the driver's iterator)."""
    position = Position()
    restored = trainer.restore_latest(position)
    return None if restored is None else (*restored, position.value)


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
