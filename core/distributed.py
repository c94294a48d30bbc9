"""One JAX process among several (multi-controller JAX): joining the group, and host reads of global arrays.

    join(ProcessGroup("10.0.0.1:7777", num_processes=2, process_id=i))   # before anything queries a device
    mesh = make_mesh(cfg.mesh)            # then every process sees the global devices: one mesh over all of them
    host = to_host(learner.params)        # numpy of every array, spread over other processes' devices or not
    barrier("compiled step 3")            # every process waits here for the others (the coordinator's barrier)
    if is_primary(): write_files()        # what one process does for all: files, messages

Every process runs the same program (SPMD): the same jitted steps, in the same order, on the same global
shapes. Each process puts on its devices only the part of a global batch they hold (`place_rows`:
`jax.make_array_from_process_local_data` with the rows `local_indices` names). On CPU the processes' collectives
go through gloo, JAX's default once `jax.distributed` is initialised; on GPU, NCCL; on TPU, ICI.

Reading a global array back is itself a collective when some of its shards live on other processes
(`jax.experimental.multihost_utils.process_allgather`): `to_host` must be called by every process.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now (for the coordinator of a group this process will lead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ProcessGroup:
    """Where a process stands in the group: the coordinator (process 0's host and a free port), the group's size,
    this process's index, and how long joining, and each `barrier`, may wait for the others."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: int = 600


def join(group: ProcessGroup) -> None:
    """`jax.distributed.initialize` for `group` (nothing for a group of one). Must run before anything queries a
    device: JAX fixes its backends at the first query."""
    if group.num_processes == 1:
        return
    if not 0 <= group.process_id < group.num_processes:
        raise ValueError(f"process {group.process_id} is not in a group of {group.num_processes}")
    global _barrier_timeout_s
    _barrier_timeout_s = group.timeout_s
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


def local_indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """The indices along `axis` of a global array of `shape` placed with `sharding` that this process's devices
    hold, ascending: the process-local data `jax.make_array_from_process_local_data` takes is the global array at
    these indices (its slices concatenated in order)."""
    held: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        assert index is not None  # a device of this process always holds some index of a global array
        held.update(range(*index[axis].indices(shape[axis])))
    return np.array(sorted(held), dtype=np.int64)


def place_rows(x: Any, sharding: jax.sharding.Sharding, axis: int) -> jax.Array:
    """The host array `x` (the same on every process) as one global array with `sharding`, sharded along `axis`
    only: each process transfers just its own devices' part (the whole of it in a group of one)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    local = np.take(np.asarray(x), local_indices(sharding, x.shape, axis), axis=axis)
    return jax.make_array_from_process_local_data(sharding, local, x.shape)


def from_every_process(x: np.ndarray) -> np.ndarray:
    """`x` of every process, stacked in process order: `[processes, ...]` (a collective: every process calls it,
    with the same shape; they may reach it at different times, so they meet at a barrier first)."""
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    barrier("from_every_process")
    return np.asarray(multihost_utils.process_allgather(x))


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process of the group (a collective: every process calls it)."""
    return bool(from_every_process(np.array([flag])).any())


class CompiledTogether:
    """A jitted function, called as usual; in a process group each new argument signature is compiled first, and
    every process waits at a barrier for the others before running it. XLA:CPU's gloo collectives give up after
    30 s of waiting (jax issue 40831, no setting raises it): a process that compiles a program later than the
    others would otherwise fail the collectives of its first run. (The call after `lower().compile()` finds the
    executable in JAX's compilation cache.)"""

    def __init__(self, jitted: Any, what: str):
        self.jitted, self.what = jitted, what
        self._seen: set = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if jax.process_count() > 1:
            leaves, tree = jax.tree.flatten((args, kwargs))
            key = (tree, tuple(_signature(x) for x in leaves))
            if key not in self._seen:
                self.jitted.lower(*args, **kwargs).compile()
                barrier(f"compiled {self.what}")
                self._seen.add(key)
        return self.jitted(*args, **kwargs)


def _signature(x: Any) -> Any:
    """What a compiled program depends on: an array's shape, dtype and sharding; any other (static) value itself."""
    if isinstance(x, jax.Array):
        return (x.shape, str(x.dtype), x.sharding)
    if isinstance(x, np.ndarray):
        return (x.shape, str(x.dtype))
    return x


def primary_first(fn: Callable[[], T], what: str) -> T:
    """`fn()` on the first process, then on the others once it returned: for what writes files the others then
    read (a tokenizer trained for the run), which every process calls."""
    if is_primary():
        out = fn()
        barrier(what)
        return out
    barrier(what)
    return fn()


def is_primary() -> bool:
    """Whether this process writes what the group writes once (files, exports, the console's messages)."""
    return jax.process_index() == 0


_barriers = itertools.count()
_barrier_timeout_s: float = 600.0  # the group's (`ProcessGroup.timeout_s`), set by `join`


def barrier(what: str) -> None:
    """Wait until every process of the group reaches its barrier of the same number (nothing in a group of one).

    The coordination service's barrier, not a device collective: XLA:CPU's gloo collectives give up after 30 s of
    waiting (jax issue 40831), which a process that compiles a step later than the others exceeds; waiting here
    first, up to the group's timeout, makes the collectives after it start together. Every process must call it in the
    same order (it is numbered), as every process runs the same programs in the same order."""
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost  # JAX's coordination-service client, as Orbax's own barriers use it

    name = f"temper-{next(_barriers)}"
    client = multihost.get_jax_distributed_client()
    try:
        client.wait_at_barrier(name, int(_barrier_timeout_s * 1000))
    except Exception as err:
        raise TimeoutError(
            f"process {jax.process_index()}: the other processes of the group did not reach barrier {name} "
            f"({what}) within {_barrier_timeout_s:.0f} s: {err}"
        ) from None
