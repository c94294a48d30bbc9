"""Where a run's time went: its productive step time against compilation, start-up and everything between steps.

    meter = Goodput(RunStart.now())                    # when the run began (its config loaded)
    meter.step(seconds=1.3, compile_s=0.2)             # a step as it ends: its wall time, the compilation waited for
    meter.summary()                                    # goodput, time to first step, ... for run_info.json

A step's productive time is its wall time less the compilation it waited for (tracing, lowering, XLA, or the wait
for a shape compiled ahead that was not ready yet: `core.compile_cache.CompileClock`). Goodput is the productive
time over the wall time from the first step's start to the last one's end, so the hooks between steps (evaluation,
checkpoints) and every compilation count against it. Start-up (loading the model, starting Ray and the samplers)
is reported apart, as the time to the first step, as MaxText reports its job start apart from its step goodput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core.compile_cache import CompileTally, compile_clock


@dataclass(frozen=True)
class RunStart:
    """When a run began to be built: `time.perf_counter()`, and this process's compile clock then."""

    time: float
    compiled: CompileTally = field(default_factory=CompileTally)

    @classmethod
    def now(cls) -> RunStart:
        return cls(time.perf_counter(), compile_clock().read())


@dataclass
class Goodput:
    start: RunStart
    productive_s: float = 0.0
    compile_s: float = 0.0
    steps: int = 0
    first_step_start: float | None = None
    first_step_end: float | None = None
    last_step_end: float | None = None

    def step(self, seconds: float, compile_s: float, now: float | None = None) -> None:
        """A step that just ended (at `now`, default: now): its wall time and the compilation it waited for."""
        now = time.perf_counter() if now is None else now
        if self.first_step_start is None:
            self.first_step_start = now - seconds
        if self.first_step_end is None:
            self.first_step_end = now
        self.last_step_end = now
        self.steps += 1
        self.compile_s += compile_s
        self.productive_s += max(0.0, seconds - compile_s)

    @property
    def goodput(self) -> float | None:
        if self.first_step_start is None or self.last_step_end is None:
            return None
        wall = self.last_step_end - self.first_step_start
        return self.productive_s / wall if wall > 0 else None

    def summary(self, elsewhere: CompileTally | None = None) -> dict[str, float | None]:
        """What `run_info.json` records: goodput, the steps' productive and compile seconds, the start-up and the
        time to the first step (from the run's start), all in seconds; and everything this process compiled since
        the run's start (with `elsewhere`: other processes' too), start-up included: the waits for tracing,
        lowering and XLA, the XLA part alone, XLA's compilations and the persistent cache's loads."""
        first_end = None if self.first_step_end is None else self.first_step_end - self.start.time
        startup = None if self.first_step_start is None else self.first_step_start - self.start.time
        wall = None
        if self.first_step_start is not None and self.last_step_end is not None:
            wall = self.last_step_end - self.first_step_start
        return {
            "goodput": self.goodput,
            "steps_wall_s": wall,
            "productive_s": self.productive_s,
            "compile_s": self.compile_s,
            "startup_s": startup,
            "time_to_first_step_s": first_end,
            **self.compiled(elsewhere),
        }

    def compiled(self, elsewhere: CompileTally | None = None) -> dict[str, float]:
        total = compile_clock().read() - self.start.compiled + (elsewhere or CompileTally())
        return {
            "run_compile_s": total.seconds,
            "run_xla_compile_s": total.xla_seconds,
            "run_compilations": float(total.compiles),
            "run_cache_hits": float(total.cache_hits),
            "run_background_compile_s": total.background_seconds,
        }

    def line(self, elsewhere: CompileTally | None = None) -> str:
        return summary_line(self.summary(elsewhere), self.steps)


def summary_line(s: dict[str, float | None], steps: int) -> str:
    """One line of a run's time summary (`Goodput.summary`, as `run_info.json["time"]` holds it) over `steps` steps."""
    if s["goodput"] is None:
        return "goodput: no step trained"
    return (
        f"goodput {s['goodput']:.1%} ({s['productive_s']:.1f} s productive of {s['steps_wall_s']:.1f} s over "
        f"{steps} steps; {s['compile_s']:.1f} s waiting for compilation); start-up {s['startup_s']:.1f} s, "
        f"time to the first step {s['time_to_first_step_s']:.1f} s; the run compiled for "
        f"{s['run_compile_s']:.1f} s (XLA {s['run_xla_compile_s']:.1f} s, {s['run_compilations']:.0f} "
        f"compilations, {s['run_cache_hits']:.0f} loaded from the cache)"
    )
