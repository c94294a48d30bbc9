"""An offline method's run (pretraining, SFT, DPO, offline and online distillation): in this process, or as a JAX
process group of Ray actors.

    summary = fit_offline(cfg, SFT)     # posttrain.fit.fit(cfg, SFT): python -m recipes.sft CONFIG.yml

With `placement.trainer_processes` = 1 (the default) this is `core.run.build_run(cfg, method).fit()` here. With
N > 1 the run is N Ray actors, one JAX process each (`posttrain.process_group`), in the trainer's placement group
(`placement.trainer_strategy`): every process builds the same run from the same config and trains it step for
step (SPMD), on one mesh over all their devices. Each reads and packs the same data stream and places only the rows
its devices hold (`core.train.place_batch`), so a global batch is the one a single process would train on; all
processes write their shards of each checkpoint (Orbax) and the first one writes everything else: metrics, plots,
the tokenizer it trains, the reference store, the Hugging Face export. The run directory (and what the config
reads) must be where every node sees it: a shared filesystem across nodes.

The driver prints process 0's output as it comes (`run_dir/logs/trainer-0.log`) and returns its answer. A process
that dies stops the group with `TrainerUnavailable` naming it and its node, and so does a group whose process 0
writes nothing for `placement.call_timeout_s` (hung: NCCL collectives have no timeout of their own); the same
command resumes from the last checkpoint.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from core.config import Config
from core.method import Method
from core.run import build_run
from posttrain.fit import RunSummary


class OfflineProcess:
    """The run, as one process of the group hosts it: built and trained when the driver calls `fit`."""

    def __init__(self, cfg: Config, method: Method):
        self.cfg, self.method = cfg, method

    def fit(self) -> RunSummary:
        run = build_run(self.cfg, self.method)
        steps = int(run.fit().step)  # skipped non-finite ones included
        run_dir = Path(run.cfg.run.run_dir)
        hf_dir = run_dir / "hf" if run.cfg.checkpoint.export_hf else None
        return RunSummary(run_dir, steps, steps, None, hf_dir)


def fit_offline(cfg: Config, method: Method) -> RunSummary:
    """Train `method` to `train.steps` (resuming from `run.run_dir`), in this process or in a process group."""
    if cfg.placement.trainer_processes == 1:
        return OfflineProcess(cfg, method).fit()
    from ray.util.placement_group import remove_placement_group

    from posttrain.process_group import start_group
    from rollout.placement import reserve_trainer
    from rollout.ray import ensure_ray

    method.check(cfg)  # before a cluster starts
    ensure_ray()
    pg = reserve_trainer(cfg.placement)
    group = None
    log = Path(cfg.run.run_dir) / "logs" / "trainer-0.log"
    seen = log.stat().st_size if log.exists() else 0  # a resumed run's log goes on after the last one's
    try:
        group = start_group(pg, cfg.placement, cfg.run.run_dir, OfflineProcess, (cfg, method))
        refs = group.submit(OfflineProcess.fit)
        if not _follow(log, seen, refs, quiet_s=cfg.placement.call_timeout_s):
            quiet = TimeoutError(f"no output for placement.call_timeout_s={cfg.placement.call_timeout_s} s")
            raise group.unavailable("fit", quiet, 0)
        return group.wait(refs, "fit", timeout_s=60.0)[0]
    finally:
        if group is not None:
            group.kill()
        remove_placement_group(pg)


def _follow(log: Path, offset: int, refs: list[Any], quiet_s: float, every_s: float = 1.0) -> bool:
    """Print what `log` holds past `offset`, as it comes, until one of `refs` is done (the run ended, or a process
    failed: True) or the log stays the same for `quiet_s` (a hung group: False)."""
    import ray

    last = time.monotonic()
    while True:
        done, _ = ray.wait(refs, num_returns=1, timeout=every_s)
        if log.exists():
            with log.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            if chunk:
                last = time.monotonic()
        if done:
            return True
        if time.monotonic() - last > quiet_s:
            return False
