"""A dataset method's run (pretraining, SFT, DPO, offline and online distillation): its trainer in this process, or
as a JAX process group of Ray actors; the run itself in this process either way.

    summary = fit_offline(cfg, SFT)     # posttrain.fit.fit(cfg, SFT): python -m recipes.sft CONFIG.yml

With `placement.trainer_processes` = 1 (the default) this is `core.run.build_run(cfg, method).fit()`. With N > 1
the trainer is N Ray actors, one JAX process each (`posttrain.process_group`), in the trainer's placement group
(`placement.trainer_strategy`), on one mesh over all their devices, behind the same handle an on-policy run's trainer
has (`posttrain.trainer.TrainerHandle`). The run stays here, as with a trainer in this process: the data pipeline,
the loop, its hooks and metrics; each step's batch goes to every process, which places the rows its devices hold
(`core.train.place_batch`), so a global batch is the one a single process would train on. Every process writes its
shards of each checkpoint (Orbax) with the data's position beside them (`core.trainer.Position`); the first writes
the export. The run directory (and what the config reads) must be where every node sees it: a shared filesystem
across nodes.

Each trainer process writes its output to `run_dir/logs/trainer-<rank>.log`. A process that dies stops the group
with `TrainerUnavailable` naming it and its node, and so does a call that takes longer than
`placement.call_timeout_s` (hung: NCCL collectives have no timeout of their own; a pass over a dataset, DPO's
stored reference, gets that for each of its batches); the same command resumes from the last checkpoint. The
profiler traces this process, so it is refused with a group.
"""

from __future__ import annotations

from pathlib import Path

from core.config import Config
from core.config_loader import ConfigError
from core.method import Method
from core.run import RunSummary, build_run


def fit_offline(cfg: Config, method: Method) -> RunSummary:
    """Train `method` to `train.steps` (resuming from `run.run_dir`), its trainer here or in a process group."""
    run_dir = Path(cfg.run.run_dir)
    if cfg.placement.trainer_processes == 1:
        return build_run(cfg, method).fit()
    from ray.util.placement_group import remove_placement_group

    from posttrain.process_group import start_group
    from posttrain.trainer import LocalTrainer, TrainerHandle
    from rollout.placement import reserve_trainer
    from rollout.ray import ensure_ray

    method.check(cfg)  # before a cluster starts
    if cfg.profiler.enabled:
        raise ConfigError(
            f"profiler.enabled traces this process, and with placement.trainer_processes="
            f"{cfg.placement.trainer_processes} the trainer's steps run in its actors: profile with "
            "placement.trainer_processes=1"
        )
    ensure_ray()
    pg = reserve_trainer(cfg.placement)
    handle: TrainerHandle | None = None

    def start(cfg: Config) -> TrainerHandle:
        nonlocal handle
        group = start_group(pg, cfg.placement, run_dir, LocalTrainer, (cfg, str(run_dir), method, (1.0, 0.0)))
        handle = TrainerHandle(run_dir, group=group)
        return handle

    try:
        return build_run(cfg, method, start_trainer=start).fit()
    finally:
        if handle is not None:
            handle.kill()
        remove_placement_group(pg)
