"""Compilation ahead of need: one background thread that compiles, in order, at the lowest CPU priority, while the
run goes on (a learner's next batch shapes, `core.shape_plan`; the JAX sampler's larger cache windows,
`rollout.jax_engine`).

    compiler = BackgroundCompiler("update")
    future = compiler.submit(lambda: step.lower(*abstract_args).compile())
    ...
    if future.done(): executable = future.result()      # never waited for while something else will do

The thread is named with `core.compile_cache.BACKGROUND_PREFIX`, so the compile clock counts its time apart (nothing
waits for it). A job that raises hands its exception to its future: whoever needs the program compiles it in the
foreground and meets the error there. When the process exits, the jobs not started are dropped and the one
compiling is waited for: a daemon thread stopped inside XLA's compiler aborts the process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from core.compile_cache import BACKGROUND_PREFIX


class BackgroundCompiler:
    def __init__(self, name: str):
        self.name = f"{BACKGROUND_PREFIX}-{name}"
        self._jobs: queue.Queue | None = None
        self._futures: list[Future] = []
        self._idle = threading.Event()
        self._idle.set()
        _compilers.add(self)

    def submit(self, job: Callable[[], Any]) -> Future:
        """Run `job` (a compilation) in the background thread after those before it; its future."""
        future: Future = Future()
        self._futures = [f for f in self._futures if not f.done()] + [future]  # done ones are their owners' now
        if self._jobs is None:
            self._jobs = queue.Queue()
            # The thread holds the queue and the event, never this object: when its owner (a learner's shape plan,
            # an engine's programs) is collected, the finalizer's None ends the thread.
            threading.Thread(target=_work, args=(self._jobs, self._idle), name=self.name, daemon=True).start()
            weakref.finalize(self, self._jobs.put, None).atexit = False  # at exit, _finish_at_exit's to stop
        self._idle.clear()
        self._jobs.put((job, future))
        return future

    def cancel(self) -> None:
        """Drop the jobs not started (the one compiling finishes in its daemon thread)."""
        for future in self._futures:
            future.cancel()
        self._futures = [f for f in self._futures if not f.done()]

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no job runs or waits (True), or `timeout_s` passed (False)."""
        return self._idle.wait(timeout_s)


def _work(jobs: queue.Queue, idle: threading.Event) -> None:
    with contextlib.suppress(AttributeError, OSError):  # the lowest priority: a step beside it keeps its cores
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    while (item := jobs.get()) is not None:
        job, future = item
        idle.clear()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except Exception as err:
                future.set_exception(err)
        # Nothing of the job stays referenced while the thread waits: its closure holds a learner's whole state.
        item = job = future = None
        if jobs.empty():
            idle.set()
    idle.set()


_compilers: weakref.WeakSet[BackgroundCompiler] = weakref.WeakSet()  # this process's, for its exit


@atexit.register
def _finish_at_exit() -> None:
    """At the process's exit (atexit runs while daemon threads still do): drop every job not started and wait for
    the ones compiling, at most 10 minutes."""
    for compiler in list(_compilers):
        compiler.cancel()
    for compiler in list(_compilers):
        compiler.wait_idle(600)
