"""This machine's floors, measured in the benchmark's own process: what a step could not go below.

    floors = Floors.measure()
    floors.flops(290e9)      # seconds 290 GFLOP take at the float32 matmul peak
    floors.read(412e6)       # seconds reading 412 MB takes at the measured read bandwidth
    floors.copy(412e6)       # seconds copying 412 MB takes (np.copyto into a warm buffer)
    floors.line()            # the three rates, for a benchmark's output
    rows_matmul_rate(16, 768, 2560)   # FLOP/s of a 16-row matmul: what a decode step's kernels reach

A figure beside its floor says how far it is from the machine, not from a peer: a target a floor rules out is
answered with that floor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a float32 [n, n] x [n, n] matmul under XLA (the best of `repeats`)."""
    from core.metrics import measure_matmul_peak

    return max(measure_matmul_peak(n, repeats=repeats), measure_matmul_peak(2 * n, repeats=2))


def rows_matmul_rate(rows: int, d: int, f: int, repeats: int = 20) -> float:
    """FLOP/s of a float32 [rows, d] x [d, f] matmul under XLA: the shape of a decode step's projections, whose
    few rows XLA:CPU's GEMM runs far below the square peak (a kernel's limit, not the machine's)."""
    import jax
    import jax.numpy as jnp

    x, w = jnp.ones((rows, d), jnp.float32), jnp.ones((d, f), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(x, w).block_until_ready()
    return 2.0 * rows * d * f / _best(lambda: matmul(x, w).block_until_ready(), repeats)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes/s of reading a float32 array once under XLA (a sum over it: one pass, no write)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    return nbytes / _best(lambda: total(x).block_until_ready(), repeats)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes/s of np.copyto into a warm buffer (first-touch page faults are not a copy's)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return nbytes / _best(lambda: np.copyto(dst, src), repeats)


@dataclass(frozen=True)
class Floors:
    peak_flops: float  # float32 matmul FLOP/s
    read_bytes_s: float
    copy_bytes_s: float

    @classmethod
    def measure(cls) -> Floors:
        return cls(matmul_peak(), read_bandwidth(), copy_bandwidth())

    def flops(self, flops: float) -> float:
        return flops / self.peak_flops

    def read(self, nbytes: float) -> float:
        return nbytes / self.read_bytes_s

    def copy(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_s

    def line(self) -> str:
        return (
            f"floors measured here: float32 matmul {self.peak_flops / 1e9:.0f} GFLOP/s, read "
            f"{self.read_bytes_s / 1e9:.1f} GB/s, copy {self.copy_bytes_s / 1e9:.1f} GB/s"
        )
