"""Host memory for CPU training: back malloc with transparent huge pages.

XLA's CPU backend allocates every step's buffers afresh. With 4 KiB pages the
kernel then faults them in page by page: ~417k minor faults (1.7 GB) per step
of a 90M-parameter GRPO update, about a tenth of its time. glibc's
`glibc.malloc.hugetlb=1` tunable makes malloc ask for 2 MiB transparent huge
pages instead (where THP is in `madvise` mode, the common default), so the
same step takes ~800 faults (figures: docs/benchmarks.md).

glibc reads tunables when a process starts, so this is an environment for
processes still to be started: the trainer actor (`posttrain.trainer`) and the
Makefile's demo and benchmark targets. Not for torch processes (vLLM, TRL):
torch's CPU allocations got slower with it here (TRL's 100M GRPO step
4.77 -> 5.03 s, tiny 0.13 -> 0.26 s); nor for the test suite, whose many
short-lived processes start a few percent slower.
"""

from __future__ import annotations

import os

HUGEPAGE_MALLOC = "glibc.malloc.hugetlb=1"


def malloc_tunables(current: str | None = None) -> str:
    """`GLIBC_TUNABLES` with huge-page malloc added to what `current` (default: this process's) sets;
    a `glibc.malloc.hugetlb` already chosen there is kept."""
    current = os.environ.get("GLIBC_TUNABLES", "") if current is None else current
    if "glibc.malloc.hugetlb=" in current:
        return current
    return ":".join(t for t in (current, HUGEPAGE_MALLOC) if t)
