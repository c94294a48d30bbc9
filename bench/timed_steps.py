"""What a learner-level bench's Temper steps compiled, and their goodput, from `core.compile_cache`'s clock.

    steps = TimedSteps()
    seconds, update = steps.run(learner.update, batch)     # one step: its wall time and what it waited to compile
    steps.line()  # "goodput 58.3% over 7 steps (27.1 s compiling, first step 35.6 s); 0 compilations in timed steps"

The benches that drive a `core.learner.Learner` directly interleave Temper's steps with a peer's, so a run's
goodput (`core.goodput`: productive time over the wall time from the first step's start) would count the peer's
steps as Temper's idle time. Here goodput is over Temper's own steps: their wall time less the compilation they
waited for, over their wall time, the first (compiling) step included. A timed step is every step but the first;
a timed step that compiled is not a steady step, so the count is printed beside the times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.compile_cache import CompileTally, compile_clock


@dataclass
class TimedSteps:
    """Each step's wall seconds and what it compiled (`CompileTally` deltas of this process's compile clock)."""

    seconds: list[float] = field(default_factory=list)
    compiled: list[CompileTally] = field(default_factory=list)

    def run(self, step: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        """Run `step(*args)` as one step (its result must be ready when it returns: a host value, or blocked on)."""
        clock = compile_clock()
        before, start = clock.read(), time.perf_counter()
        result = step(*args)
        seconds = time.perf_counter() - start
        self.seconds.append(seconds)
        self.compiled.append(clock.read() - before)
        return seconds, result

    @property
    def timed_compilations(self) -> int:
        """XLA compilations (not cache loads) in the steps after the first."""
        return sum(c.compiles for c in self.compiled[1:])

    @property
    def goodput(self) -> float:
        wall = sum(self.seconds)
        compiling = sum(min(c.seconds, s) for c, s in zip(self.compiled, self.seconds, strict=True))
        return (wall - compiling) / wall if wall > 0 else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "goodput": self.goodput,
            "compile_s": sum(c.seconds for c in self.compiled),
            "first_step_s": self.seconds[0] if self.seconds else 0.0,
            "timed_compilations": float(self.timed_compilations),
        }

    def line(self) -> str:
        s = self.summary()
        return (
            f"goodput {s['goodput']:.1%} over {len(self.seconds)} steps ({s['compile_s']:.1f} s compiling, first "
            f"step {s['first_step_s']:.1f} s); {self.timed_compilations} compilations in timed steps"
        )
