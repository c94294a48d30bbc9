"""Jobs run one at a time, in order, in a daemon thread: the episodes of async multi-turn rollouts, run while the
trainer trains.

    jobs = Background("episodes")
    future = jobs.submit(fn, *args)      # a concurrent.futures.Future
    jobs.close(timeout_s=30)             # cancel what has not started; ask the running job to stop; wait a while

A daemon thread, not an executor's: a run that stops on an error ends even when a job is stuck (an executor's
threads are joined at interpreter exit). `cancelled` is set by `close`; a job checks it between its units of work
(`rollout.turns.EngineTurns` between engine calls) and stops with `Cancelled`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Cancelled(RuntimeError):
    """The job stopped because its `Background` is closing."""


class Background:
    def __init__(self, name: str):
        self.cancelled = threading.Event()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # the caller's, through the future
                future.set_exception(err)

    def close(self, timeout_s: float) -> None:
        """Cancel the jobs not started, ask the running one to stop, and wait up to `timeout_s` for it."""
        self.cancelled.set()
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        self._jobs.put((None, None, None))
        self._thread.join(timeout_s)
