"""The offline training loop: a `core.learner.Learner`'s update on each batch, then hooks that own their cadence.

    learner = Learner(model, mesh, nll_loss, cfg.optim, total_updates=cfg.train.steps, seed=cfg.run.seed)
    loop = TrainLoop(cfg, learner, train_pipeline, evaluation=Evaluation(...), tokenizer_dir=..., hooks=[...])
    state = loop.fit()

Every offline method runs here (pretraining, SFT, offline DPO; `core.run.build_run` assembles the loop from a
method): the data yields `core.data.DataBatch`es, the method's `prepare` turns each into what its loss reads
(attaching a frozen model's log-probs, say; default: the batch itself), the learner trains on it. The built-in
hooks log (`train.log_every`), evaluate (`train.eval_every`: the loss and the loss's own metrics, as means over
the held-out split, plus what the method derives from them) and checkpoint (`checkpoint.every_steps`); a
method adds its own. A restart on the same `run.run_dir` resumes from the latest checkpoint that restores
(parameters, optimizer, step, RNG and data-iterator position). SIGTERM saves a checkpoint and returns cleanly.
A non-finite loss or gradient never reaches the parameters; `train.nan_policy` (`core.learner.apply_nan_policy`,
the on-policy methods' too) then either skips the step or aborts after making sure a checkpoint of the last good
state exists.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from core.checkpoint import Checkpointer
from core.config import Config
from core.config_loader import save_config
from core.data import DataBatch
from core.distributed import any_process
from core.learner import Learner, NonFiniteLoss, apply_nan_policy
from core.metrics import (
    MetricsLogger,
    device_memory,
    library_versions,
    model_flops_per_token,
    peak_flops_per_device,
    plot_curves,
    read_metrics,
    update_run_info,
)
from core.models import param_count
from core.train import TrainState

__all__ = ["Evaluation", "Hook", "NonFiniteLoss", "Prepare", "TrainLoop"]

H = TypeVar("H")


@dataclass
class Hook(Generic[H]):
    """Runs `fn(owner, step)` after every `every`-th step (never when `every` is 0): the owner is the loop that
    runs it (a `TrainLoop`, or the on-policy methods' `posttrain.onpolicy.run.OnPolicyRun`)."""

    name: str
    every: int
    fn: Callable[[H, int], None]

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


# (a pipeline's item, the packing groups its rows form: train.micro_batches when training, 1 when evaluating)
# -> what the method's loss reads.
Prepare = Callable[[DataBatch, int], Any]


def _as_is(data: DataBatch, groups: int) -> Any:
    return data.batch


@dataclass
class Evaluation:
    """The held-out evaluation of an offline method: one pass over `batches()`, each prepared as for training,
    the loss and every metric the loss sums reported as means over the split (`eval/loss`, `eval/<metric>`),
    plus what `derive` computes from those means (the perplexity of a next-token loss)."""

    batches: Callable[[], Iterable[DataBatch]]
    derive: Callable[[dict[str, float]], dict[str, float]] | None = None


class TrainLoop:
    def __init__(
        self,
        cfg: Config,
        learner: Learner,
        train_data: Iterable,
        *,
        evaluation: Evaluation | None = None,
        tokenizer_dir: str | None = None,
        on_batch: Callable[[int, object], None] | None = None,
        prepare: Prepare = _as_is,
        hooks: Sequence[Hook] = (),
        console: dict[str, str] | None = None,
    ):
        """`on_batch(step, data_batch)` sees every batch before its step (data inspection, debugging);
        `prepare(data_batch, groups)` turns it into what the learner trains on (default: its `.batch`), inside the
        timed step (DPO attaches the reference's log-probs there); `hooks` run after the built-in log, eval and
        checkpoint hooks; `console` names the method's metrics the console line shows (key -> label)."""
        self.cfg = cfg
        self.learner = learner
        self.mesh = learner.mesh
        self.run_dir = Path(cfg.run.run_dir)
        self.total_steps = cfg.train.steps
        self.tokenizer_dir = tokenizer_dir
        self.evaluation = evaluation
        self.on_batch = on_batch
        self.prepare = prepare
        save_config(cfg, self.run_dir)
        self.data_iter = iter(train_data)

        self.ckpt = None
        start = 0
        if cfg.checkpoint.enabled:
            self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.async_save)
            restored = learner.restore_latest(self.ckpt, cfg, self.data_iter)
            if restored is not None:
                start = restored[0]
                print(f"resumed from {self.ckpt.directory}/{start}", flush=True)
        self.start_step = start
        self.logger = MetricsLogger(self.run_dir, cfg.logging, self.total_steps, resume_step=start, console=console)
        self.peak_flops, peak_source = peak_flops_per_device(cfg.logging)
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.data.seq_len)
        print(device_memory() + " (after model and optimizer load)", flush=True)
        update_run_info(
            self.run_dir,
            param_count=param_count(learner.model()),
            flops_per_token=self.flops_per_token,
            peak_flops_per_device=self.peak_flops,
            peak_source=peak_source,
            devices=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            mesh=dict(self.mesh.shape),
            versions=library_versions(),
        )
        self.hooks: list[Hook] = [
            Hook("log", cfg.train.log_every, TrainLoop._log),
            Hook("eval", cfg.train.eval_every if evaluation else 0, TrainLoop._evaluate),
            Hook("checkpoint", cfg.checkpoint.every_steps if self.ckpt else 0, TrainLoop._checkpoint),
            *hooks,
        ]
        self._window: list[dict] = []
        self._stop = False
        self._compiled = False

    @property
    def state(self) -> TrainState:
        return self.learner.state

    # ------------------------------------------------------------------ loop

    def fit(self) -> TrainState:
        # Signal handlers live in the main thread only (a Ray actor's calls may run on another: then Ray's own
        # handling of SIGTERM stays).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if main else None
        try:
            for step in range(self.start_step + 1, self.total_steps + 1):
                with self._profiling(step):
                    metrics = self._train_step(step)
                if not metrics["finite"]:
                    self._non_finite(step, metrics)
                for hook in self.hooks:
                    if hook.due(step):
                        hook.fn(self, step)
                # Every process of a group stops at the same step, if any of them was told to (a collective).
                if any_process(self._stop):
                    self._save_if_new()
                    print(f"SIGTERM: checkpoint saved at step {int(self.state.step)}; exiting", flush=True)
                    return self.state
            self._finish()
            return self.state
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
            if self.ckpt:
                self.ckpt.wait()
            self.logger.close()

    def _train_step(self, step: int) -> dict[str, float]:
        data = next(self.data_iter)
        if self.on_batch is not None:
            self.on_batch(step, data)
        micro = self.cfg.train.micro_batches
        start = time.perf_counter()
        batch = self.prepare(data, micro)
        prepare_seconds = time.perf_counter() - start
        if not self._compiled:  # compile time is not step time
            print(self.learner.compile(batch, micro), flush=True)
            self._compiled = True
        start = time.perf_counter()
        metrics = self.learner.update(batch, micro)
        seconds = time.perf_counter() - start + prepare_seconds
        n_tokens = int(np.prod(batch.packed.tokens.shape))  # any method's batch: core.batch.TrainBatch
        flops = self.flops_per_token * n_tokens / seconds
        metrics.update(
            step_seconds=seconds,
            tokens_per_s=n_tokens / seconds,
            tflops_per_s=flops / 1e12,
            mfu=flops / (self.peak_flops * jax.device_count()),
        )
        if step == self.start_step + 1:
            line = device_memory()
            print(line + " (after the first step)", flush=True)
            update_run_info(self.run_dir, memory_after_first_step=line.split(": ", 1)[1])
        self._window.append(metrics)
        return metrics

    def _non_finite(self, step: int, metrics: dict) -> None:
        try:
            apply_nan_policy(metrics, self.cfg.train.nan_policy, f"step {step}")
        except NonFiniteLoss as err:
            self._save_if_new()
            where = f" ({self.ckpt.directory})" if self.ckpt else ""
            raise NonFiniteLoss(
                f"{err}. Checkpoint {step}{where} holds the last good parameters and optimizer state, with the data "
                f"positioned after the bad batch. Set train.nan_policy=skip to skip such steps."
            ) from None

    # ----------------------------------------------------------------- hooks

    def _log(self, step: int) -> None:
        window, self._window = self._window, []
        means = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
        means["skipped_steps"] = float(sum(1 for m in window if not m["finite"]))
        means.pop("finite")
        means.pop("empty")
        means["learning_rate"] = window[-1].get("learning_rate", 0.0)
        self.logger.log(step, means)

    def _evaluate(self, step: int) -> None:
        self.logger.log(step, self.evaluate(), console=True)

    def evaluate(self) -> dict[str, float]:
        """`eval/loss` and `eval/<metric>`: the loss's sums over the held-out split, each divided by the summed
        denominator (a mean per target token, per pair, ...), and what the method derives from them."""
        assert self.evaluation is not None  # the hook is registered only with one
        totals: dict[str, float] = {}
        for data in self.evaluation.batches():
            loss_sum, sums = self.learner.evaluate(self.prepare(data, 1))
            for k, v in {"loss": loss_sum, **sums}.items():
                totals[k] = totals.get(k, 0.0) + v
        n = max(totals.pop("loss_denominator", 0.0), 1.0)
        means = {k: v / n for k, v in totals.items()}
        if self.evaluation.derive is not None:
            means.update(self.evaluation.derive(means))
        return {f"eval/{k}": v for k, v in means.items()}

    def _checkpoint(self, step: int) -> None:
        self._save_if_new()

    def _save_if_new(self) -> None:
        if self.ckpt and self.ckpt.latest_step() != int(self.state.step):
            self.learner.save(self.ckpt, self.cfg, self.data_iter)

    def _finish(self) -> None:
        if self._window:
            self._log(int(self.state.step))
        if self.ckpt:
            self._save_if_new()
            self.ckpt.wait()
        if self.cfg.checkpoint.export_hf:
            out = self.learner.export_hf(self.run_dir / "hf", self.tokenizer_dir)
            print(f"exported Hugging Face model to {out}", flush=True)
        plot, rows = None, []
        if self.cfg.logging.jsonl:  # the plot and the summary read metrics.jsonl
            plot = plot_curves(self.run_dir)
            rows = [r for r in read_metrics(self.run_dir) if "loss" in r]
        update_run_info(
            self.run_dir,
            final_loss=rows[-1]["loss"] if rows else None,
            mean_step_seconds=float(np.mean([r["step_seconds"] for r in rows])) if rows else None,
            loss_plot=str(plot) if plot else None,
        )

    # ------------------------------------------------------------- plumbing

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True

    def _profiling(self, step: int):
        return _Profiler(self.cfg, self.run_dir, step)


class _Profiler:
    """Starts a JAX trace at `profiler.start_step` and stops it `num_steps` later."""

    def __init__(self, cfg: Config, run_dir: Path, step: int):
        p = cfg.profiler
        self.start = p.enabled and step == p.start_step
        self.stop = p.enabled and step == p.start_step + p.num_steps - 1
        self.dir = p.dir or str(run_dir / "profile")

    def __enter__(self):
        if self.start:
            jax.profiler.start_trace(self.dir)

    def __exit__(self, *exc):
        if self.stop:
            jax.profiler.stop_trace()
            print(f"profiler trace written to {self.dir}", flush=True)
