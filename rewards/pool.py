"""A pool of worker processes that survives the user code it runs: reward functions, environments, tools.

    pool = WorkerPool(num_procs=2)
    values, errors = pool.run("math_verify", kwargs, prompts, completions, columns, timeout=10.0)
    results = pool.call([Call("environment", "tools", {...}, "step", (state, turn)), ...], timeout=10.0)
    pool.close()

`call` runs independent calls of a plugin's method (an environment's `reset` or `step`, built once per worker
from its spec and keyword arguments) spread over the workers, each with its own deadline: a call that raises,
overruns it (its worker is killed and replaced) or kills its worker comes back as a `CallResult` with an error
message, the others with their values.

The batch is cut into one contiguous shard per worker. A shard whose function
raises, returns something other than one number per completion, overruns the
timeout (the worker is killed) or kills its worker (the worker is replaced)
comes back as `None` values with a message; everything else is returned in
the original order. Workers are processes, not threads, because math-verify
times out with `signal.alarm`, which only works in a main thread; they fork
from a clean forkserver (never from a process that already runs JAX threads).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

# Imported once in the forkserver, so a replacement worker starts in milliseconds.
_PRELOAD = ["rewards.registry", "rewards.mathverify", "rewards.gsm8k", "rewards.shaping", "math_verify", "sympy"]


def _as_numbers(out: Any, n: int) -> tuple[list[float | None], str | None]:
    """One finite float per completion; None (and the first complaint) for anything else."""
    try:
        out = list(out)
    except TypeError:
        return [None] * n, f"returned {type(out).__name__}, not a list of floats"
    if len(out) != n:
        return [None] * n, f"returned {len(out)} values for {n} completions"
    values: list[float | None] = []
    first: str | None = None
    for i, v in enumerate(out):
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x):
            values.append(None)
            first = first or f"item {i}: {v!r} is not a finite number"
        else:
            values.append(x)
    return values, first


@dataclass(frozen=True)
class Call:
    """One call of `method(*args)` on the plugin `spec` of `kind` (`rewards.registry.KINDS`), built as
    `resolve(spec)(**kwargs)` once per worker."""

    kind: str
    spec: str
    kwargs: Mapping[str, Any]
    method: str
    args: tuple
    worker: int | None = None  # the worker that must run it (one keeping what an earlier call left there); None: any


@dataclass(frozen=True)
class CallResult:
    value: Any = None
    error: str | None = None  # why there is no value: the call raised, timed out or killed its worker
    worker: int | None = None  # the worker that ran it


def _worker_main(conn) -> None:
    import json

    from rewards.registry import resolve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    built: dict[tuple, Any] = {}  # the plugins this worker built, by (kind, spec, kwargs)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        if isinstance(task, Call):
            try:
                key = (task.kind, task.spec, json.dumps(task.kwargs, sort_keys=True, default=repr))
                if key not in built:
                    built[key] = resolve(task.spec, task.kind)(**task.kwargs)
                reply: tuple = ("ok", getattr(built[key], task.method)(*task.args), None)
            except BaseException as e:
                reply = ("error", None, f"{type(e).__name__}: {e}")
            try:
                conn.send(reply)
            except Exception as e:  # a value that does not pickle
                conn.send(("error", None, f"{task.method} returned what cannot be sent back: {type(e).__name__}: {e}"))
            continue
        spec, kwargs, prompts, completions, columns = task
        try:
            out = resolve(spec)(prompts, completions, **{**columns, **kwargs})
            reply = ("ok", *_as_numbers(out, len(completions)))
        except BaseException as e:
            reply = ("error", [], f"{type(e).__name__}: {e}")
        conn.send(reply)


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="temper-reward-worker")
        self.process.start()
        child.close()

    def kill(self) -> int | None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        return self.process.exitcode


class WorkerPool:
    def __init__(self, num_procs: int):
        if num_procs < 1:
            raise ValueError(f"num_procs must be >= 1, got {num_procs}")
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._workers = [_Worker(self._ctx) for _ in range(num_procs)]
        self.restarts = 0
        # One batch at a time: an async run scores one request while the environment steps another's episodes.
        self._lock = threading.Lock()

    @property
    def num_procs(self) -> int:
        return len(self._workers)

    def run(
        self,
        spec: str,
        kwargs: Mapping[str, Any],
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, Sequence],
        timeout: float,
    ) -> tuple[list[float | None], list[str]]:
        """Score a batch; returns per-item values (None = failed) and one message per failed shard."""
        with self._lock:
            self._check_open()
            return self._run(spec, kwargs, prompts, completions, columns, timeout)

    def _run(self, spec, kwargs, prompts, completions, columns, timeout) -> tuple[list[float | None], list[str]]:
        n = len(completions)
        bounds = shards_of(n, self.num_procs)
        values: list[float | None] = [None] * n
        errors: list[str] = []
        pending = {}
        for worker, (lo, hi) in zip(self._workers, bounds):
            task = (
                spec,
                dict(kwargs),
                list(prompts[lo:hi]),
                list(completions[lo:hi]),
                {k: list(v[lo:hi]) for k, v in columns.items()},
            )
            try:
                worker.conn.send(task)
                pending[worker.conn] = (worker, lo, hi)
            except (BrokenPipeError, OSError):  # died between batches
                self._replace(worker)
                errors.append(f"items {lo}-{hi - 1}: worker was dead")
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for worker, lo, hi in pending.values():
                    self._replace(worker)
                    errors.append(f"items {lo}-{hi - 1}: timed out after {timeout:g} s")
                break
            for conn in ready:
                worker, lo, hi = pending.pop(conn)
                try:
                    status, shard_values, message = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=5)
                    code = worker.process.exitcode
                    self._replace(worker)
                    errors.append(f"items {lo}-{hi - 1}: worker died (exit code {code})")
                    continue
                if status == "ok":
                    values[lo:hi] = shard_values
                if message is not None:
                    errors.append(f"items {lo}-{hi - 1}: {message}")
        return values, errors

    def call(self, calls: Sequence[Call], timeout: float) -> list[CallResult]:
        """Each call's result, in order; calls run on the workers as they come free, each with `timeout` seconds
        from when it starts."""
        with self._lock:
            self._check_open()
            return self._call(calls, timeout)

    def _check_open(self) -> None:
        if not self._workers:
            raise RuntimeError("the worker pool is closed")

    def _call(self, calls: Sequence[Call], timeout: float) -> list[CallResult]:
        results: list[CallResult | None] = [None] * len(calls)
        for i, c in enumerate(calls):
            if c.worker is not None and not 0 <= c.worker < len(self._workers):
                results[i] = CallResult(error=f"its worker died (the pool has no worker {c.worker})")
        queue = [i for i in range(len(calls)) if results[i] is None]  # in order; a pinned call waits for its worker
        idle = list(self._workers)
        running: dict[Any, tuple[_Worker, int, float]] = {}  # conn -> (worker, call index, deadline)
        while queue or running:
            for worker in list(idle):
                at = self._workers.index(worker)
                # the first call pinned to this worker (it can run nowhere else), else the first call for any
                pick = next((j for j in queue if calls[j].worker == at), None)
                if pick is None:
                    pick = next((j for j in queue if calls[j].worker is None), None)
                if pick is None:
                    continue
                idle.remove(worker)
                queue.remove(pick)
                try:
                    worker.conn.send(calls[pick])
                    running[worker.conn] = (worker, pick, time.monotonic() + timeout)
                except (BrokenPipeError, OSError):  # died between calls: replaced, the call goes back in line
                    idle.append(self._replace(worker))
                    queue.insert(0, pick)
            if not running:
                continue
            first_deadline = min(d for _, _, d in running.values())
            ready = wait(list(running), timeout=max(0.0, first_deadline - time.monotonic()))
            for conn in ready:
                worker, i, _ = running.pop(conn)
                try:
                    status, value, message = worker.conn.recv()
                    results[i] = CallResult(value if status == "ok" else None, message, self._workers.index(worker))
                    idle.append(worker)
                except (EOFError, OSError):
                    worker.process.join(timeout=5)
                    code = worker.process.exitcode
                    results[i] = CallResult(error=f"its worker died (exit code {code})")
                    idle.append(self._replace(worker))
            now = time.monotonic()
            for conn, (worker, i, deadline) in list(running.items()):
                if deadline <= now:
                    del running[conn]
                    results[i] = CallResult(error=f"timed out after {timeout:g} s")
                    idle.append(self._replace(worker))
        return [r if r is not None else CallResult(error="not run") for r in results]

    def _replace(self, worker: _Worker) -> _Worker:
        """A new worker in `worker`'s place (killed first)."""
        worker.kill()
        at = self._workers.index(worker)
        self._workers[at] = _Worker(self._ctx)
        self.restarts += 1
        return self._workers[at]

    def close(self) -> None:
        """Stop the workers (after the batch in progress in another thread, if any)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []


def shards_of(n: int, k: int) -> list[tuple[int, int]]:
    """Up to k contiguous [lo, hi) ranges covering n items, as even as possible."""
    k = max(1, min(k, n))
    step, extra = divmod(n, k)
    bounds, lo = [], 0
    for i in range(k):
        hi = lo + step + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds
