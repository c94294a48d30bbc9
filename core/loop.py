"""The training loop: the jitted step, then hooks that own their cadence.

    trainer = Trainer(cfg, model, loss_fn, train_pipeline, mesh=mesh, eval_pipeline_fn=...)
    state = trainer.fit()

A restart on the same `run.run_dir` resumes from the latest checkpoint
(parameters, optimizer, step, RNG and data-iterator position). SIGTERM saves a
checkpoint and returns cleanly. A non-finite loss or gradient never reaches the
parameters; `train.nan_policy` then either skips the step or aborts after
making sure a checkpoint of the last good state exists.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from core.checkpoint import Checkpointer
from core.config import Config
from core.config_loader import save_config
from core.errors import TemperError
from core.hf import save_hf
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
from core.optim import make_optimizer, make_schedule
from core.train import (
    LossFn,
    TrainState,
    batch_sharding,
    init_train_state,
    jit_train_step,
    make_train_step,
    memory_analysis_line,
    split_micro_batches,
)


class NonFiniteLoss(TemperError, FloatingPointError):
    """Raised under `train.nan_policy=abort`; a checkpoint of the last good state has been written."""


@dataclass
class Hook:
    """Runs `fn(step, trainer)` after every `every`-th step (never when `every` is 0)."""

    name: str
    every: int
    fn: Callable[[int, Trainer], None]

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


class Trainer:
    def __init__(
        self,
        cfg: Config,
        model: nnx.Module,
        loss_fn: LossFn,
        train_data: Iterable,
        *,
        mesh: Mesh,
        eval_data_fn: Callable[[], Iterable] | None = None,
        tokenizer_dir: str | None = None,
        on_batch: Callable[[int, dict], None] | None = None,
    ):
        """`on_batch(step, host_batch)` sees every batch before its step (data inspection, debugging)."""
        self.cfg = cfg
        self.mesh = mesh
        self.model_cfg = cfg.model
        self.run_dir = Path(cfg.run.run_dir)
        self.total_steps = cfg.train.steps
        self.tokenizer_dir = tokenizer_dir
        self.eval_data_fn = eval_data_fn
        self.on_batch = on_batch
        save_config(cfg, self.run_dir)

        params = nnx.state(model)
        self.schedule = make_schedule(cfg.optim, self.total_steps)
        self.tx = make_optimizer(cfg.optim, self.total_steps, params)
        with jax.set_mesh(mesh):
            self.graphdef, self.state = init_train_state(model, self.tx, cfg.run.seed)
        step = make_train_step(self.graphdef, loss_fn, self.tx, self.schedule)
        self._jitted = jit_train_step(step, self.state)
        self._compiled = None
        self._eval_step = jax.jit(lambda p, b: loss_fn(nnx.merge(self.graphdef, p), b, jax.random.key(0)))
        self.data_iter = iter(train_data)

        self.ckpt = None
        start = 0
        if cfg.checkpoint.enabled:
            self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.async_save)
            restored = self.ckpt.restore_latest(self.state, self.data_iter, cfg)
            if restored is not None:
                self.state, _, start = restored
                print(f"resumed from {self.ckpt.directory}/{start}", flush=True)
        self.start_step = start
        self.logger = MetricsLogger(self.run_dir, cfg.logging, self.total_steps, resume_step=start)
        self.peak_flops, peak_source = peak_flops_per_device(cfg.logging)
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.data.seq_len)
        print(device_memory() + " (after model and optimizer load)", flush=True)
        update_run_info(
            self.run_dir,
            param_count=param_count(model),
            flops_per_token=self.flops_per_token,
            peak_flops_per_device=self.peak_flops,
            peak_source=peak_source,
            devices=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            mesh=dict(mesh.shape),
            versions=library_versions(),
        )
        self.hooks = [
            Hook("log", cfg.train.log_every, Trainer._log),
            Hook("eval", cfg.train.eval_every if eval_data_fn else 0, Trainer._evaluate),
            Hook("checkpoint", cfg.checkpoint.every_steps if self.ckpt else 0, Trainer._checkpoint),
        ]
        self._window: list[dict] = []
        self._stop = False

    # ------------------------------------------------------------------ loop

    def fit(self) -> TrainState:
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            for step in range(self.start_step + 1, self.total_steps + 1):
                with self._profiling(step):
                    metrics = self._train_step(step)
                if not metrics["finite"]:
                    self._non_finite(step, metrics)
                for hook in self.hooks:
                    if hook.due(step):
                        hook.fn(self, step)
                if self._stop:
                    self._save_if_new()
                    print(f"SIGTERM: checkpoint saved at step {int(self.state.step)}; exiting", flush=True)
                    return self.state
            self._finish()
            return self.state
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self.ckpt:
                self.ckpt.wait()
            self.logger.close()

    def _train_step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        host_batch = next(self.data_iter)
        if self.on_batch is not None:
            self.on_batch(step, host_batch)
        batch = split_micro_batches(host_batch, self.cfg.train.micro_batches)
        batch = {k: jax.device_put(v, batch_sharding(self.mesh, v.shape)) for k, v in batch.items()}
        first = self._compiled is None
        if first:
            with jax.set_mesh(self.mesh):  # activation sharding constraints apply under the mesh
                self._compiled = self._jitted.lower(self.state, batch).compile()
            print(memory_analysis_line(self._compiled), flush=True)
            start = time.perf_counter()  # compile time is not step time
        self.state, metrics = self._compiled(self.state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        seconds = time.perf_counter() - start
        n_tokens = int(np.prod(batch["tokens"].shape))
        flops = self.flops_per_token * n_tokens / seconds
        metrics.update(
            step_seconds=seconds,
            tokens_per_s=n_tokens / seconds,
            tflops_per_s=flops / 1e12,
            mfu=flops / (self.peak_flops * jax.device_count()),
        )
        if first:
            line = device_memory()
            print(line + " (after the first step)", flush=True)
            update_run_info(self.run_dir, memory_after_first_step=line.split(": ", 1)[1])
        self._window.append(metrics)
        return metrics

    def _non_finite(self, step: int, metrics: dict) -> None:
        if self.cfg.train.nan_policy == "skip":
            print(
                f"step {step}: non-finite loss {metrics['loss']} / grad norm {metrics['grad_norm']}: update skipped",
                flush=True,
            )
            return
        self._save_if_new()
        where = f" ({self.ckpt.directory})" if self.ckpt else ""
        raise NonFiniteLoss(
            f"step {step}: loss {metrics['loss']}, grad norm {metrics['grad_norm']}: the update was not applied. "
            f"Checkpoint {step}{where} holds the last good parameters and optimizer state, with the data "
            f"positioned after the bad batch. Set train.nan_policy=skip to skip such steps."
        )

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
        total = denom = 0.0
        for batch in self.eval_data_fn():
            batch = _pad_batch(batch, self.cfg.train.batch_size)
            with jax.set_mesh(self.mesh):
                loss_sum, m = self._eval_step(self.state.params, batch)
            total += float(loss_sum)
            denom += float(m["loss_denominator"])
        self.logger.log(step, {"eval_loss": total / max(denom, 1.0)}, console=True)

    def _checkpoint(self, step: int) -> None:
        self._save_if_new()

    def _save_if_new(self) -> None:
        if self.ckpt and self.ckpt.latest_step() != int(self.state.step):
            self.ckpt.save(self.state, self.data_iter, self.cfg)

    def _finish(self) -> None:
        if self._window:
            self._log(int(self.state.step))
        if self.ckpt:
            self._save_if_new()
            self.ckpt.wait()
        if self.cfg.checkpoint.export_hf:
            model = nnx.merge(self.graphdef, self.state.params)
            out = save_hf(model, self.model_cfg, self.run_dir / "hf", tokenizer_dir=self.tokenizer_dir)
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


def _pad_batch(batch: dict[str, np.ndarray], rows: int) -> dict[str, jnp.ndarray]:
    """Pad a (last, short) eval batch with empty rows so every eval batch has one shape."""
    n = batch["tokens"].shape[0]
    if n >= rows:
        return batch
    return {
        k: np.concatenate([v, np.full((rows - n, *v.shape[1:]), -1 if k == "example_ids" else 0, v.dtype)])
        for k, v in batch.items()
    }
