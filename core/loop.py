"""The one training loop: steps, then hooks that own their cadence; the NaN policy, SIGTERM, resume and the end.

    class MyRun(Loop):                   # where batches come from and how a step trains
        def train_step(self, step): ...
        def save(self, step): ...
    last = MyRun(...).fit()

The run every method trains in, `core.train_loop.TrainLoop` (any `core.batch_source.BatchSource`: a dataset's or
the samplers'), is this loop's one subclass: it says how a step trains (`train_step`), logs (`log`), evaluates
(`evaluate`), checkpoints (`save`, `saved_step`) and exports (`export`). The skeleton is kept apart so that what a
step is and what surrounds every step read separately; everything below is here, once:

- hooks: log (`train.log_every`), eval (`train.eval_every`; `train.eval_on_start`: at step 0 too), checkpoint
  (`checkpoint.every_steps`), then the method's own (`Hook`), each after the step it is due on;
- the NaN policy: a step whose update was not finite under `train.nan_policy=abort` raises `NonFiniteLoss`
  (`core.learner.apply_nan_policy`, where the update is); the loop then saves a checkpoint of the state without
  that update, the data positioned after its batch, and raises the error saying so; `skip` goes on;
- SIGTERM (in the main thread): the step in progress finishes, a checkpoint is saved and `fit` returns; in a
  process group every process stops at the same step;
- the end: the last checkpoint (unless the hook just wrote it), the Hugging Face export (`checkpoint.export_hf`),
  the curves as PNGs, and a summary in `run_info.json`, with where the time went (`core.goodput`: goodput, the
  compilation steps waited for, start-up, time to the first step);
- compilation: each step's wait for compilation in this process (`core.compile_cache.CompileClock`) and in the
  trainer's other processes (`compile_elsewhere`: a trainer actor's), which the run logs (`step_compile`:
  `time/compile`, `compile/compilations`, `compile/cache_hits`);
- a profiler trace of `profiler.num_steps` steps from `profiler.start_step`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import jax

from core.compile_cache import CompileTally, compile_clock
from core.config import Config
from core.distributed import any_process
from core.goodput import Goodput, RunStart
from core.learner import NonFiniteLoss
from core.metrics import (
    plot_curves,
    update_run_info,
)

__all__ = ["Hook", "Loop", "NonFiniteLoss", "Plot"]

H = TypeVar("H")


@dataclass
class Hook(Generic[H]):
    """Runs `fn(loop, step)` after every `every`-th step (never when `every` is 0)."""

    name: str
    every: int
    fn: Callable[[H, int], None]

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


@dataclass(frozen=True)
class Plot:
    """A PNG of logged curves the run draws at its end (`core.metrics.plot_curves`)."""

    keys: tuple[str, ...]
    out: str
    ylabel: str


class Loop:
    """The skeleton of the run (module docstring); its subclass says what a step is."""

    plots: Sequence[Plot] = ()

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        start_step: int,
        hooks: Sequence[Hook] = (),
        evaluates=True,
        started: RunStart | None = None,
    ):
        """`start_step`: the step a resumed run restored (0: a fresh run); `hooks`: the method's own, after the
        built-in log, eval and checkpoint hooks; `evaluates`: whether there is anything to evaluate; `started`:
        when the run began to be built (default: now), what its time to the first step and its compilations count
        from."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.start_step = start_step
        self.total_steps = cfg.train.steps
        checkpoints = cfg.checkpoint.every_steps if cfg.checkpoint.enabled else 0
        # The built-in hooks call the subclass's `log`, `evaluate` and `save`.
        self.hooks: list[Hook] = [
            Hook("log", cfg.train.log_every, lambda loop, step: loop.log(step)),
            Hook("eval", cfg.train.eval_every if evaluates else 0, lambda loop, step: loop.evaluate(step)),
            Hook("checkpoint", checkpoints, lambda loop, step: loop._save_if_new(step)),
            *hooks,
        ]
        self._stop = False
        self.clock = compile_clock()
        self.goodput = Goodput(started or RunStart.now())
        self._step_clock = self.clock.read()

    # ---------------------------------------------------------------- the subclass's

    def train_step(self, step: int) -> None:
        """One step: its batch(es), the update(s), what follows an update (a weight sync). An update that was not
        finite under `train.nan_policy=abort` raises `NonFiniteLoss`."""
        raise NotImplementedError

    def log(self, step: int) -> None:
        """The `train.log_every` hook."""

    def evaluate(self, step: int) -> Any:
        """The `train.eval_every` hook."""

    def save(self, step: int) -> None:
        """A checkpoint at `step` from which the run resumes exactly."""
        raise NotImplementedError

    def saved_step(self) -> int | None:
        """The latest checkpoint's step (None: none)."""
        return None

    def export(self) -> Path | None:
        """The Hugging Face export (`checkpoint.export_hf`) into `run_dir/hf`; its directory."""
        return None

    def flush_log(self, step: int) -> None:
        """Log what the last `log` did not (the end of a run between two log steps)."""

    def summary(self, step: int) -> dict[str, Any]:
        """What the end of the run adds to `run_info.json`."""
        return {}

    def close_logs(self) -> None:
        """Close what the loop writes (its metrics logger, pending checkpoint writes), however it ended."""

    def compile_elsewhere(self) -> CompileTally:
        """What the step in progress compiled in processes other than this one (a trainer actor); this process's
        own the loop's clock counts."""
        return CompileTally()

    def compiled_elsewhere(self) -> CompileTally | None:
        """What the run compiled so far in processes other than this one (a trainer actor), start-up included."""
        return None

    def step_compile(self) -> CompileTally:
        """What the step in progress has compiled so far, in this process and elsewhere, and the time it waited for
        it: what the run logs (`CompileTally.metrics`: `time/compile`, `compile/compilations`, ...)."""
        return self.clock.read() - self._step_clock + self.compile_elsewhere()

    # ------------------------------------------------------------------- the loop

    def fit(self) -> int:
        """Train from `start_step` to `train.steps`; the last step trained (on SIGTERM: the step it stopped at)."""
        # Signal handlers live in the main thread only (a Ray actor's calls may run on another: then Ray's own
        # handling of SIGTERM stays).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if main else None
        step = self.start_step
        try:
            evaluates = any(hook.name == "eval" and hook.every for hook in self.hooks)
            if self.start_step == 0 and self.cfg.train.eval_on_start and evaluates:
                self.evaluate(0)  # the starting model's, logged at step 0
            for step in range(self.start_step + 1, self.total_steps + 1):
                self._step_clock, began = self.clock.read(), time.perf_counter()
                try:
                    with _Profiler(self.cfg, self.run_dir, step):
                        self.train_step(step)
                except NonFiniteLoss as err:
                    self._abort(step, err)
                self.goodput.step(time.perf_counter() - began, self.step_compile().seconds)
                for hook in self.hooks:
                    if hook.due(step):
                        hook.fn(self, step)
                # Every process of a group stops at the same step, if any of them was told to (a collective).
                if any_process(self._stop):
                    self._save_if_new(step)
                    print(f"SIGTERM: checkpoint saved at step {step}; exiting", flush=True)
                    return step
            self._finish(step)
            return step
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
            self.close_logs()

    def _save_if_new(self, step: int) -> None:
        if self.cfg.checkpoint.enabled and self.saved_step() != step:
            self.save(step)

    def _abort(self, step: int, err: NonFiniteLoss) -> None:
        """`train.nan_policy=abort`: a checkpoint of the state without the bad update, then the error saying so."""
        saved = ""
        if self.cfg.checkpoint.enabled:
            self._save_if_new(step)
            saved = (
                f" Checkpoint {self.run_dir / 'checkpoints' / str(step)} holds the parameters and optimizer state "
                f"without that update (every update applied was finite), with the data positioned after its batch: "
                f"the same command resumes past it."
            )
        raise NonFiniteLoss(f"{err}.{saved} Set train.nan_policy=skip to skip such updates.") from None

    def _finish(self, step: int) -> None:
        self.flush_log(step)
        if step > self.start_step:
            self._save_if_new(step)
        hf_dir = self.export() if self.cfg.checkpoint.export_hf else None
        if hf_dir is not None:
            print(f"exported Hugging Face model to {hf_dir}", flush=True)
        drawn = {}
        if self.cfg.logging.jsonl:  # the plots read metrics.jsonl
            for plot in self.plots:
                path = plot_curves(self.run_dir, keys=plot.keys, out=plot.out, ylabel=plot.ylabel)
                drawn[plot.out] = str(path) if path else None
        if self.goodput.steps:
            print(self.goodput.line(self.compiled_elsewhere()), flush=True)
        update_run_info(
            self.run_dir,
            plots=drawn,
            hf_dir=str(hf_dir) if hf_dir else None,
            time=self.goodput.summary(self.compiled_elsewhere()),
            **self.summary(step),
        )

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True


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
