"""The one run: a source's batch (`core.batch_source.BatchSource`), one step of the method's trainer, what follows an
update, in the one loop (`core.loop.Loop`).

    loop = TrainLoop(cfg, trainer, DatasetSource(pipeline, evaluation=Evaluation(...)))   # a dataset's batches
    loop = TrainLoop(cfg, trainer, SamplerSource(...))                                     # the samplers'
    loop.fit()

Every method trains here. The trainer is a `core.trainer.Trainer` in this process or a handle on one in each
process of a JAX process group (`posttrain.trainer.TrainerHandle`): the loop makes the same calls of either. Each
step: the source's batch (`next`), the trainer's step (`Method.attach`, the method's updates under
`train.nan_policy`, its report), then the source hears of the update (`after_update`: the samplers' weight sync).
Every step's metrics go to the run's logs (metrics.jsonl, TensorBoard, W&B): the source's, the trainer's, the time
(`time/step_s`, `time/train_s`, `step_seconds` = the step less its wait for compilation), the throughput of the
trained batch (`tokens_per_s`: its packed token slots per `step_seconds`; `tflops_per_s`, `mfu`) and compilation;
every `train.log_every` steps a console line shows the means since the last. `train.eval_every` runs the source's
held-out evaluation. A restart on the same `run.run_dir` resumes from the latest checkpoint that restores
(parameters, optimizer, step, RNG, policy version and the source's position).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.batch_source import BatchSource, Drawn
from core.compile_cache import CompileTally
from core.config import Config
from core.config_loader import save_config
from core.goodput import RunStart
from core.learner import Learner
from core.loop import Hook, Loop, Plot
from core.metrics import MetricsLogger, library_versions, model_flops_per_token, read_metrics, update_run_info
from core.train import TrainState
from core.trainer import Trainer, TrainerCalls


class TrainLoop(Loop):
    """The one run (module docstring)."""

    def __init__(
        self,
        cfg: Config,
        trainer: TrainerCalls,
        source: BatchSource,
        *,
        tokenizer_dir: str | None = None,
        on_batch: Callable[[int, object], None] | None = None,
        hooks: Sequence[Hook] = (),
        started: RunStart | None = None,
    ):
        """`trainer`: a `core.trainer.Trainer` in this process, or a handle on one in each process of a group
        (`posttrain.trainer.TrainerHandle`); `on_batch(step, item)` sees each step's source item before its step
        (data inspection, debugging); `hooks` run after the built-in log, eval and checkpoint hooks; `started`:
        when the run began to be built (`Loop`)."""
        self.trainer = trainer
        self.source = source
        self.tokenizer_dir = tokenizer_dir
        self.on_batch = on_batch
        run_dir = Path(cfg.run.run_dir)
        save_config(cfg, run_dir)
        start = 0
        if cfg.checkpoint.enabled:
            restored = trainer.restore_latest(source.position)
            if restored is not None:
                start = source.restore(*restored)
                print(
                    f"resumed from {run_dir / 'checkpoints' / str(restored[0])} at step {start} "
                    f"(policy version {trainer.version()})",
                    flush=True,
                )
        super().__init__(cfg, run_dir, start, hooks, evaluates=source.evaluates, started=started)
        self.logger = MetricsLogger(run_dir, cfg.logging, self.total_steps, resume_step=start, console=source.console)
        self.facts = trainer.facts()
        self.peak_flops = self.facts.peak_flops  # the trainer's devices', wherever they are
        print(trainer.device_memory() + " (after model and optimizer load)", flush=True)
        update_run_info(
            run_dir,
            param_count=self.facts.param_count,
            peak_flops_per_device=self.peak_flops,
            peak_source=self.facts.peak_source,
            devices=f"{self.facts.devices} x {self.facts.device_kind}",
            mesh=self.facts.mesh,
            versions=library_versions(),
        )
        self._window: list[dict[str, float]] = []  # the steps since the last console line
        self._line = ""  # the last step's method part of the console line
        self._skipped = 0.0  # the trainer's count of skipped updates so far
        self._trainer_compile = CompileTally()  # the step's, in the trainer's processes (a group's)
        self.last_metrics: dict[str, float] = {}  # the last step's, as logged
        self.final_eval: dict[str, float] | None = None  # the latest held-out evaluation at a step
        self.hf_dir: Path | None = None

    @property
    def plots(self) -> Sequence[Plot]:  # type: ignore[override]
        return self.source.plots

    @property
    def learner(self) -> Learner:
        """The `core.learner.Learner` (the model, its state) of a trainer in this process."""
        if not isinstance(self.trainer, Trainer):  # a handle on a process group's
            raise RuntimeError("the trainer runs in Ray actors, not in this process: ask it with trainer.apply")
        return self.trainer.learner.learner

    @property
    def state(self) -> TrainState:
        return self.learner.state

    def compile_elsewhere(self) -> CompileTally:
        return self._trainer_compile

    def compiled_elsewhere(self) -> CompileTally | None:
        return self.trainer.compiled() if self.trainer.remote else None

    def train_step(self, step: int) -> None:
        began = time.perf_counter()
        drawn = self.source.next()
        if self.on_batch is not None:
            self.on_batch(step, drawn.item)
        metrics = {**drawn.metrics, "time/train_s": 0.0}
        line = drawn.line
        self._trainer_compile = CompileTally()
        if drawn.batch is not None:  # None: nothing to learn from this step, and the samplers hold these weights
            t0 = time.perf_counter()
            with self.source.lock:
                stats = self.trainer.train(drawn.batch, step)  # attach -> updates (train.nan_policy) -> report
            metrics["time/train_s"] = time.perf_counter() - t0
            if self.trainer.remote:  # a trainer here compiles on this process's clock
                self._trainer_compile = stats.compile
            skipped, self._skipped = stats.metrics["skipped_updates"] > self._skipped, stats.metrics["skipped_updates"]
            metrics.update(stats.metrics)
            metrics["skipped_steps"] = float(skipped)
            line = " | ".join(part for part in (line, stats.line) if part)
        # every step: a source that drew no batch syncs none; it reads the step's metrics (an entropy it steers toward)
        metrics.update(self.source.after_update(self.trainer, metrics))
        compiled, step_s = self.step_compile(), time.perf_counter() - began
        if drawn.batch is not None:  # (its diagnostics after the step's time)
            metrics.update(self._throughput(drawn, step, step_s - compiled.seconds, compiled))
        metrics["time/step_s"] = step_s
        metrics.update(compiled.metrics())
        self.last_metrics, self._line = metrics, line
        self._window.append(metrics)
        self.logger.log(step, metrics, console=False)  # every step's metrics are kept

    def _throughput(self, drawn: Drawn, step: int, seconds: float, compiled: CompileTally) -> dict[str, float]:
        """The trained batch's token slots per second of the step less its compilation, and the model FLOP/s that
        makes (MFU: over the trainer devices' peak); XLA's memory analysis when the update compiled."""
        first = step == self.start_step + 1
        if first or compiled.compiles:
            memory = self.trainer.memory_analysis()
            if memory:  # of the update's newest program (compiled, or loaded from the cache)
                print(memory, flush=True)
        if first:
            line = self.trainer.device_memory()
            print(line + " (after the first step)", flush=True)
            update_run_info(self.run_dir, memory_after_first_step=line.split(": ", 1)[1])
        packed = drawn.batch.packed  # any method's batch: core.batch.TrainBatch
        shape, seconds = packed.tokens.shape, max(seconds, 1e-9)
        flops = model_flops_per_token(self.cfg.model, shape[-1]) * int(np.prod(shape)) / seconds
        return {
            "step_seconds": seconds,
            "tokens_per_s": int(np.prod(shape)) / seconds,
            "tflops_per_s": flops / 1e12,
            "mfu": flops / (self.peak_flops * self.facts.devices),
            "pack/rows": float(packed.rows),
            "pack/fill": float(packed.fill()),
        }

    def log(self, step: int) -> None:
        """The console line: the means of the steps since the last one, the last step's method part."""
        window, self._window = self._window, []
        if not window:
            return
        keys = {k for m in window for k in m}
        means = {k: float(np.mean([m[k] for m in window if k in m])) for k in keys}
        rates = [m["learning_rate"] for m in window if "learning_rate" in m]  # a step without an update has none
        if rates:
            means["learning_rate"] = rates[-1]
        print(self.logger.console_line(step, means, self._line), flush=True)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """The source's held-out evaluation; with a `step`, logged and kept as the run's latest."""
        values = self.source.evaluate(self.trainer)
        if step is not None and values:  # a source with nothing to evaluate logs nothing
            self.logger.log(step, values, console=False)
            shown = ", ".join(f"{k.split('/', 1)[-1]} {v:.4g}" for k, v in values.items())
            print(f"eval @ step {step}: {shown}", flush=True)
            self.final_eval = values
        return values

    def save(self, step: int) -> None:
        meta, position = self.source.checkpoint()
        self.trainer.save(step, meta, position)

    def saved_step(self) -> int | None:
        return self.trainer.latest_step() if self.cfg.checkpoint.enabled else None

    def export(self) -> Path | None:
        self.hf_dir = Path(self.trainer.export(str(self.run_dir / "hf"), self.tokenizer_dir))
        return self.hf_dir

    def flush_log(self, step: int) -> None:
        if self._window:
            self.log(step)

    def summary(self, step: int) -> dict[str, Any]:
        rows = [r for r in read_metrics(self.run_dir) if "loss" in r] if self.cfg.logging.jsonl else []
        return {
            "steps": step,
            "policy_version": self.trainer.version(),
            "final_eval": self.final_eval,
            "final_loss": rows[-1]["loss"] if rows else None,
            "mean_step_seconds": float(np.mean([r["step_seconds"] for r in rows])) if rows else None,
        }

    def close_logs(self) -> None:
        if not self.trainer.lost:  # a trainer group that is gone has nothing left to write
            self.trainer.wait()
        self.logger.close()
