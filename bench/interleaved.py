"""Two sides' steps timed in alternation, so that the machine's drift falls on both alike.

    with PeerStepper(cmd, env) as torch_side:            # a peer script in --serve mode, in its own process
        result = interleave(rounds, temper_step, torch_side.step)

This VM's speed drifts by tens of percent within minutes and up to ~50% within hours (docs/benchmarks.md).
Timing one side's steps in its own block of minutes, then the other's, leaves their ratio to that drift: the
same code measured 0.62x-0.93x the plain PyTorch loop in three such runs. Here round i runs step i of both
sides back to back on the same rows, the side that went first in one round going second in the next (so
neither always follows the other's memory traffic), and the result is the median of the per-round ratios. Only
one side runs at a time: the peer process waits on its stdin while Temper steps.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Interleaved:
    """Per-round seconds of two sides (`a`, `b`), warm-up round excluded, and the median of `a_i / b_i`."""

    a_s: list[float]
    b_s: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.a_s, self.b_s, strict=True)]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    def summary(self) -> dict:
        return {
            **asdict(self),
            "a_median_s": statistics.median(self.a_s),
            "b_median_s": statistics.median(self.b_s),
            "ratios": self.ratios,
            "median_ratio": self.median_ratio,
        }


def interleave(rounds: int, a: Callable[[int], float], b: Callable[[int], float]) -> Interleaved:
    """Run `a(i)` and `b(i)` (each returns its step's seconds) for i = 0..rounds; round 0 warms both up and is
    not counted. Even rounds run `a` first, odd rounds `b` first."""
    a_s, b_s = [], []
    for i in range(rounds + 1):
        if i % 2 == 0:
            ta, tb = a(i), b(i)
        else:
            tb, ta = b(i), a(i)
        if i:
            a_s.append(ta)
            b_s.append(tb)
        print(f"   round {i}: {ta:.3f} s / {tb:.3f} s{'' if i else ' (warm-up)'}", flush=True)
    return Interleaved(a_s, b_s)


class PeerStepper:
    """A peer script in `--serve` mode: `step(rows)` sends it the row indices of one step and returns the
    seconds that step took, timed inside the peer."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str]):
        self.proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def step(self, rows: Sequence[int]) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([int(r) for r in rows]) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:  # libraries may print to stdout too: the answer is the JSON line
            if line.startswith('{"seconds"'):
                return float(json.loads(line)["seconds"])
        raise RuntimeError(f"peer {self.proc.args[1]} exited with {self.proc.wait()} before answering a step")

    def __enter__(self) -> PeerStepper:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
