"""Host memory for CPU training: malloc on transparent huge pages that stay in the process.

XLA's CPU backend allocates every step's buffers afresh. With 4 KiB pages the
kernel then faults them in page by page: ~417k minor faults (1.7 GB) per step
of a 90M-parameter GRPO update, about a tenth of its time. glibc's
`glibc.malloc.hugetlb=1` tunable makes malloc ask for 2 MiB transparent huge
pages instead (where THP is in `madvise` mode, the common default), so the
same step takes ~800 faults (figures: docs/benchmarks.md).

Huge pages alone still hand every freed buffer back to the kernel (glibc
serves large allocations with mmap and frees them with munmap; thread arenas
shrink), so each step and above all the first execution after a compilation
faults its buffers in again, and on a VM with free-page reporting the host
zeroes them too. One arena, no mmap and no trimming keep freed memory in the
process's heap for the next step: the T2 SFT step with packing went 4.7 ->
2.8 s, unpacked 2.8 -> 2.6 s (docs/benchmarks.md). The price is that the
process's resident memory stays at its peak (+1.2 GiB of 3.7 GiB there).

glibc reads tunables when a process starts, so this is an environment for
processes still to be started: the trainer actor (`posttrain.trainer`) and the
Makefile's demo and benchmark targets. Not for torch processes (vLLM, TRL):
torch's CPU allocations got slower with it here (TRL's 100M GRPO step
4.77 -> 5.03 s, tiny 0.13 -> 0.26 s); nor for the test suite, whose many
short-lived processes start a few percent slower.
"""

from __future__ import annotations

import os

HOST_MALLOC = (
    "glibc.malloc.hugetlb=1",  # 2 MiB transparent huge pages
    "glibc.malloc.arena_max=1",  # one heap: no per-thread arena that shrinks away
    "glibc.malloc.mmap_max=0",  # large buffers from the heap too, not mmap/munmap
    "glibc.malloc.trim_threshold=68719476736",  # never give the heap's top back (64 GiB)
)


def malloc_tunables(current: str | None = None) -> str:
    """`GLIBC_TUNABLES` with `HOST_MALLOC` added to what `current` (default: this process's) sets; a tunable
    already chosen there is kept."""
    current = os.environ.get("GLIBC_TUNABLES", "") if current is None else current
    chosen = {t.split("=", 1)[0] for t in current.split(":") if t}
    return ":".join([*(t for t in current.split(":") if t), *(t for t in HOST_MALLOC if t.split("=")[0] not in chosen)])
