"""The dataset kind of run: a dataset's batches (`core.batch_source.DatasetSource`), one step of the method's
trainer (`core.method_learner.MethodLearner`) each, in the one loop (`core.loop.Loop`).

    loop = TrainLoop(cfg, Trainer(cfg, SFT, model, mesh, run_dir), DatasetSource(pipeline), evaluation=Evaluation(...))
    loop.fit()

The trainer is a `core.trainer.Trainer` in this process or a handle on one in each process of a JAX process group
(`posttrain.trainer.TrainerHandle`): the loop makes the same calls of either. The source yields what the method's
loss reads; the trainer attaches its frozen models' values
(`Method.attach`), makes the method's updates (each under `train.nan_policy`) and reports; the held-out evaluation
reports the loss's own sums as means over the split (`Evaluation`); the end exports the model and what the method
exports beside it. A restart on the same `run.run_dir` resumes from the latest checkpoint that restores
(parameters, optimizer, step, RNG, policy version and the data iterator's position).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.batch_source import DatasetSource
from core.compile_cache import CompileTally
from core.config import Config
from core.config_loader import save_config
from core.data import DataBatch
from core.goodput import RunStart
from core.learner import Learner
from core.loop import Hook, Loop, Plot
from core.metrics import (
    MetricsLogger,
    library_versions,
    model_flops_per_token,
    read_metrics,
    update_run_info,
)
from core.sums import combine, means
from core.train import TrainState
from core.trainer import Trainer, TrainerCalls


@dataclass
class Evaluation:
    """The held-out evaluation of a dataset method: one pass over `batches()`, each prepared as for training,
    the loss and every sum the loss reports as means over the split (`eval/loss`, `eval/<metric>`), plus what
    `derive` computes from those means (the perplexity of a next-token loss)."""

    batches: Callable[[], Iterable[DataBatch]]
    derive: Callable[[dict[str, float]], dict[str, float]] | None = None


class TrainLoop(Loop):
    """The dataset kind of run: a dataset's batches, one step of the method's trainer each."""

    plots = (Plot(("loss", "eval/loss"), "loss.png", "loss"),)

    def __init__(
        self,
        cfg: Config,
        trainer: TrainerCalls,
        source: DatasetSource,
        *,
        evaluation: Evaluation | None = None,
        tokenizer_dir: str | None = None,
        on_batch: Callable[[int, object], None] | None = None,
        hooks: Sequence[Hook] = (),
        console: dict[str, str] | None = None,
        started: RunStart | None = None,
    ):
        """`trainer`: a `core.trainer.Trainer` in this process, or a handle on one in each process of a group
        (`posttrain.trainer.TrainerHandle`); `on_batch(step, data_batch)` sees every pipeline item before its step
        (data inspection, debugging); the source's `prepare` runs inside the timed step; `hooks` run after the
        built-in log, eval and checkpoint hooks; `console` names the method's metrics the console line shows
        (key -> label); `started`: when the run began to be built (`Loop`)."""
        self.trainer = trainer
        self.tokenizer_dir = tokenizer_dir
        self.evaluation = evaluation
        self.on_batch = on_batch
        self.source = source
        run_dir = Path(cfg.run.run_dir)
        save_config(cfg, run_dir)
        start = 0
        if cfg.checkpoint.enabled:
            restored = trainer.restore_latest(source.state)
            if restored is not None:
                start = restored[0]
                print(f"resumed from {run_dir / 'checkpoints'}/{start}", flush=True)
        super().__init__(cfg, run_dir, start, hooks, evaluates=evaluation is not None, started=started)
        self.logger = MetricsLogger(run_dir, cfg.logging, self.total_steps, resume_step=start, console=console)
        self.facts = trainer.facts()
        self.peak_flops = self.facts.peak_flops  # the trainer's devices', wherever they are
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.data.seq_len)
        print(trainer.device_memory() + " (after model and optimizer load)", flush=True)
        update_run_info(
            run_dir,
            param_count=self.facts.param_count,
            flops_per_token=self.flops_per_token,
            peak_flops_per_device=self.peak_flops,
            peak_source=self.facts.peak_source,
            devices=f"{self.facts.devices} x {self.facts.device_kind}",
            mesh=self.facts.mesh,
            versions=library_versions(),
        )
        self._window: list[dict] = []
        self._skipped = 0.0  # the trainer's count of skipped updates so far
        self._trainer_compile = CompileTally()  # the step's, in the trainer's processes (a group's)

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
        data = self.source.next_item()
        if self.on_batch is not None:
            self.on_batch(step, data)
        start = time.perf_counter()
        batch = self.source.prepare(data)
        stats = self.trainer.train(batch, step)  # attach -> the method's updates (train.nan_policy) -> its report
        self.source.after_update(self.trainer)
        if self.trainer.remote:  # a trainer here compiles on this process's clock
            self._trainer_compile = stats.compile
        compiled = self.step_compile()
        if step == self.start_step + 1 or compiled.compiles:
            memory = self.trainer.memory_analysis()
            if memory:  # XLA's memory analysis of the update's newest program (compiled, or loaded from the cache)
                print(memory, flush=True)
        seconds = max(time.perf_counter() - start - compiled.seconds, 1e-9)  # compile time is not step time
        n_tokens = int(np.prod(batch.packed.tokens.shape))  # any method's batch: core.batch.TrainBatch
        flops = self.flops_per_token * n_tokens / seconds
        counts = ("skipped_updates", "empty_updates", "time/update_s")  # the trainer's: step_seconds says it here
        skipped, self._skipped = stats.metrics["skipped_updates"] > self._skipped, stats.metrics["skipped_updates"]
        metrics = {
            **{k: v for k, v in stats.metrics.items() if k not in counts},
            "skipped": float(skipped),
            "step_seconds": seconds,
            "tokens_per_s": n_tokens / seconds,
            "tflops_per_s": flops / 1e12,
            "mfu": flops / (self.peak_flops * self.facts.devices),
            **compiled.metrics(),
        }
        if step == self.start_step + 1:
            line = self.trainer.device_memory()
            print(line + " (after the first step)", flush=True)
            update_run_info(self.run_dir, memory_after_first_step=line.split(": ", 1)[1])
        self._window.append(metrics)

    def log(self, step: int) -> None:
        window, self._window = self._window, []
        if not window:
            return
        keys = [k for k in window[0] if k != "skipped"]
        # Compilation is counted per window (a compilation in one step of ten is 1, not 0.1); the rest are means.
        summed = lambda k: k == "time/compile" or k.startswith("compile/")
        means_ = {k: float((np.sum if summed(k) else np.mean)([m[k] for m in window if k in m])) for k in keys}
        means_["skipped_steps"] = float(sum(m["skipped"] for m in window))
        means_["learning_rate"] = window[-1].get("learning_rate", 0.0)
        self.logger.log(step, means_)

    def evaluate(self, step: int) -> None:
        self.logger.log(step, self.held_out(), console=True)

    def held_out(self) -> dict[str, float]:
        """`eval/loss` and `eval/<metric>`: the loss's sums over the held-out split, each divided by the summed
        denominator (a mean per target token, per pair, ...), and what the method derives from them."""
        assert self.evaluation is not None  # the hook is registered only with one
        total, denominator, sums = 0.0, 0.0, None
        for data in self.evaluation.batches():
            out = self.trainer.evaluate(self.source.prepare(data, 1))
            total += out.total
            denominator += out.denominator
            sums = out.sums if sums is None else combine(sums, out.sums)
        values = {"loss": total / max(denominator, 1.0), **(means(sums, denominator) if sums is not None else {})}
        if self.evaluation.derive is not None:
            values.update(self.evaluation.derive(values))
        return {f"eval/{k}": v for k, v in values.items()}

    def save(self, step: int) -> None:
        self.trainer.save(step, {}, self.source.state)

    def saved_step(self) -> int | None:
        return self.trainer.latest_step() if self.cfg.checkpoint.enabled else None

    def export(self) -> Path | None:
        return Path(self.trainer.export(str(self.run_dir / "hf"), self.tokenizer_dir))

    def flush_log(self, step: int) -> None:
        if self._window:
            self.log(step)

    def summary(self, step: int) -> dict[str, Any]:
        rows = [r for r in read_metrics(self.run_dir) if "loss" in r] if self.cfg.logging.jsonl else []
        return {
            "final_loss": rows[-1]["loss"] if rows else None,
            "mean_step_seconds": float(np.mean([r["step_seconds"] for r in rows])) if rows else None,
        }

    def close_logs(self) -> None:
        if not self.trainer.lost:  # a trainer group that is gone has nothing left to write
            self.trainer.wait()
        self.logger.close()
