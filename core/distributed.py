"""One JAX process among several (multi-controller JAX): joining the group, and host reads of global arrays.

    join(ProcessGroup("10.0.0.1:7777", num_processes=2, process_id=i))   # before anything queries a device
    mesh = make_mesh(cfg.mesh)            # then every process sees the global devices: one mesh over all of them
    host = to_host(learner.params)        # numpy of every array, spread over other processes' devices or not

Every process runs the same program (SPMD): the same jitted steps, in the same order, on the same global
shapes. A host batch that every process holds whole goes onto the global mesh with `jax.device_put` as it does in
one process (each process writes the shards its own devices hold). On CPU the processes' collectives go through
gloo, JAX's default once `jax.distributed` is initialised; on GPU, NCCL; on TPU, ICI.

Reading a global array back is itself a collective when some of its shards live on other processes
(`jax.experimental.multihost_utils.process_allgather`): `to_host` must be called by every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class ProcessGroup:
    """Where a process stands in the group: the coordinator (process 0's host and a free port), the group's size,
    this process's index, and how long joining may take."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: int = 300


def join(group: ProcessGroup) -> None:
    """`jax.distributed.initialize` for `group` (nothing for a group of one). Must run before anything queries a
    device: JAX fixes its backends at the first query."""
    if group.num_processes == 1:
        return
    if not 0 <= group.process_id < group.num_processes:
        raise ValueError(f"process {group.process_id} is not in a group of {group.num_processes}")
    jax.distributed.initialize(
        group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        initialization_timeout=group.timeout_s,
    )


def to_host(tree: Any) -> Any:
    """Every array of `tree` as numpy, whole, on every process (a collective when shards live elsewhere: every
    process must call it, with the same tree)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    from jax.experimental import multihost_utils

    def read(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(read, tree)
