"""Compile once: JAX's persistent compilation cache in every process of a run, and the clock that counts what each
process compiles and how long it waits for it.

    use_compile_cache(cfg.compile)        # every process of a run, before its first compilation
    clock = compile_clock()               # this process's, from its first call on
    before = clock.read()
    ...                                   # a step
    spent = clock.read() - before         # a CompileTally: seconds waited, XLA compilations, cache loads

The cache (`compile.cache_dir`) keeps every executable a process compiles, keyed by its program, devices, compile
options and library versions, so that any later process on the machine loads it instead of compiling: a resumed run,
a second run of the same recipe, a Ray job's trainer actor. JAX treats the directory as trusted (whoever can write
to it can run code in the processes that read it), so it defaults to the user's own cache directory, never a run
directory (run directories are not trusted: `core.checkpoint`).

The clock listens to JAX's own monitoring events (`jax.monitoring`): tracing, lowering and XLA compilation (a load
from the persistent cache counts as a compilation's time, short), and the cache's hits. Time spent in threads whose
name starts with `BACKGROUND_PREFIX` (compilation ahead of need: `core.shape_plan`) is counted apart: nothing waits
for it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import astuple, dataclass
from pathlib import Path

import jax

# Threads that compile ahead of need (nothing waits for them) are named with this prefix.
BACKGROUND_PREFIX = "compile-ahead"

_TIMED_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> str:
    """`$JAX_COMPILATION_CACHE_DIR` when set (JAX's own variable), else `$XDG_CACHE_HOME/temper/jax` (by default
    `~/.cache/temper/jax`)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "temper" / "jax")


def use_compile_cache(cache_dir: str | None) -> Path | None:
    """Turn JAX's persistent compilation cache on for this process at `cache_dir` (created, private to the user),
    for every compilation however short; None turns it off. Returns the directory in use. A process can move it
    (each test its own): JAX's cache object is reset when the directory changes."""
    from jax.experimental.compilation_cache import compilation_cache

    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if cache_dir is None:
        if current is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
        return None
    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if current != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()
    # JAX caches only compilations over 1 s by default; a run's many small programs (a sampler's decode loop, a
    # frozen model's pass) add up, and loading one is faster than compiling it. JAX's own variable still wins.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


@dataclass(frozen=True)
class CompileTally:
    """What a process compiled over a stretch of time: `seconds` waited for tracing, lowering and XLA (a cache load
    included; `xla_seconds` the XLA part, what the persistent cache saves), `compiles` executables XLA built and
    `cache_hits` executables loaded from the persistent cache where something waited for them;
    `background_seconds` and `background_compiles` ahead of need, in threads nothing waited for."""

    seconds: float = 0.0
    compiles: int = 0
    cache_hits: int = 0
    background_seconds: float = 0.0
    background_compiles: int = 0
    xla_seconds: float = 0.0  # the part of `seconds` in XLA (or loading from the cache), not tracing and lowering

    def __sub__(self, other: CompileTally) -> CompileTally:
        return CompileTally(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __add__(self, other: CompileTally) -> CompileTally:
        return CompileTally(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def metrics(self) -> dict[str, float]:
        """What a step logs: `time/compile` (the wait), `compile/compilations`, `compile/cache_hits`,
        `compile/background_s`, `compile/background_compilations`."""
        return {
            "time/compile": self.seconds,
            "compile/compilations": float(self.compiles),
            "compile/cache_hits": float(self.cache_hits),
            "compile/background_s": self.background_seconds,
            "compile/background_compilations": float(self.background_compiles),
            "compile/xla_s": self.xla_seconds,
        }


class CompileClock:
    """This process's running `CompileTally`, fed by JAX's monitoring listeners (which are themselves per process:
    one clock a process, `compile_clock`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = [0.0, 0.0]  # [foreground, background]
        self._xla_seconds = 0.0  # foreground
        self._backend_calls = [0, 0]
        self._hits = [0, 0]

    def read(self) -> CompileTally:
        with self._lock:
            fg, bg = self._backend_calls[0] - self._hits[0], self._backend_calls[1] - self._hits[1]
            return CompileTally(self._seconds[0], fg, self._hits[0], self._seconds[1], bg, self._xla_seconds)

    def add_wait(self, seconds: float) -> None:
        """Time a step waited for a compilation that another thread was doing (compiled ahead, not ready yet): what
        JAX's events attribute to that thread."""
        with self._lock:
            self._seconds[0] += seconds

    def _on_duration(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event not in _TIMED_EVENTS:
            return
        where = _background()
        with self._lock:
            self._seconds[where] += duration_secs
            if event == _BACKEND:
                self._backend_calls[where] += 1
                if not where:
                    self._xla_seconds += duration_secs

    def _on_event(self, event: str, **_: str | int) -> None:
        if event == _CACHE_HIT:
            where = _background()
            with self._lock:
                self._hits[where] += 1


def _background() -> int:
    """1 in a thread that compiles ahead of need (nothing waits for it), else 0."""
    return int(threading.current_thread().name.startswith(BACKGROUND_PREFIX))


_clock: CompileClock | None = None
_clock_lock = threading.Lock()


def compile_clock() -> CompileClock:
    """This process's compile clock; it counts from the first call on (JAX's listeners are per process, so the
    clock is too)."""
    global _clock
    with _clock_lock:
        if _clock is None:
            _clock = CompileClock()
            jax.monitoring.register_event_duration_secs_listener(_clock._on_duration)
            jax.monitoring.register_event_listener(_clock._on_event)
        return _clock
