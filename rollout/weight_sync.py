"""Trainer parameters -> sampler weights, a bounded chunk at a time.

One planner (`plan_chunks`) groups tensors into chunks of at most
`rollout.reshard_chunk_bytes` (or `max_tensors`); two deliveries use it:

- `reshard_to_jax_sampler`: to a JAX sampler on another sub-mesh of this
  process (or the trainer's own). Each chunk is copied by `jax.device_put`
  straight into the sampler's `NamedSharding`s, and the sampler's old buffers
  for that chunk are freed at once, so the extra memory stays near one chunk.
  It is always a copy (`may_alias=False`): on the trainer's own mesh
  `device_put` would otherwise hand back the trainer's buffers, which its next
  step donates (deletes), and a second sync would delete them itself.
- `sync_to_vllm`: to a vLLM actor. Each Hugging Face tensor is gathered from
  the trainer mesh (one layer of a stacked parameter at a time), converted to
  the `[out, in]` layout by the shared table in `core.hf_layout`, grouped into
  chunks and streamed through the Ray object store into the actor's reusable
  receive buffers; the actor commits only a complete, well-shaped set.

Every sync bumps the policy version and returns (and logs) its bytes and time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from core.config import ModelConfig
from core.distributed import is_primary
from core.hf import hf_tensors
from core.models import state_mismatches

T = TypeVar("T")


@dataclass
class SyncStats:
    version: int
    bytes: int
    seconds: float
    chunks: int
    peak_extra_bytes: int = 0
    phases: dict | None = None  # seconds per phase (prepare: gather + layout, transfer, commit)

    def line(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 1e9
        phases = ""
        if self.phases:
            phases = " [" + ", ".join(f"{k.removesuffix('_s')} {v:.2f}s" for k, v in self.phases.items()) + "]"
        return (
            f"weight sync v{self.version}: {self.bytes / 2**20:.1f} MiB in {self.chunks} chunk(s), "
            f"{self.seconds:.3f}s ({rate:.2f} GB/s){phases}"
        )


def group_by_bytes(
    items: Iterable[T], nbytes: Callable[[T], int], chunk_bytes: int, max_tensors: int | None = None
) -> Iterator[list[T]]:
    """Consecutive groups of <= chunk_bytes (and <= max_tensors items); a bigger item travels alone."""
    group: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if group and (size + n > chunk_bytes or (max_tensors and len(group) >= max_tensors)):
            yield group
            group, size = [], 0
        group.append(item)
        size += n
    if group:
        yield group


def plan_chunks(
    sizes: Sequence[tuple[Hashable, int]], chunk_bytes: int, max_tensors: int | None = None
) -> list[list[Hashable]]:
    """Group (key, nbytes) in order into chunks of <= chunk_bytes (a bigger tensor travels alone)."""
    return [[k for k, _ in g] for g in group_by_bytes(sizes, lambda kv: kv[1], chunk_bytes, max_tensors)]


def _live_bytes(devices: set) -> int:
    """Memory held on `devices` by live arrays, every shard and replica counted.

    Computed from shard shapes (touching `shard.data` would itself create
    arrays). Only arrays living entirely on `devices` count: a cross-mesh
    `device_put` exposes the source's shards as single-device views on the
    source devices, which are not new memory.
    """
    total = 0
    for x in jax.live_arrays():
        if not x.is_deleted() and x.sharding.device_set <= devices:
            shard = np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)
            total += int(shard) * x.dtype.itemsize * len(x.sharding.device_set)
    return total


# ------------------------------------------------------------- JAX -> JAX


def reshard_to_jax_sampler(
    params: nnx.State,
    sampler: Any,
    chunk_bytes: int,
    max_tensors: int | None = None,
    version: int | None = None,
    measure_memory: bool = False,
) -> SyncStats:
    """Copy trainer `params` into a `JaxSampler`'s shardings chunk by chunk, freeing its old buffers.

    With `measure_memory`, `peak_extra_bytes` is the most memory the sync held on
    the sampler's devices beyond the sampler's own weights (a debugging aid:
    it walks all live arrays after every chunk).
    """
    start = time.perf_counter()
    problems = state_mismatches(sampler.params, params, check_dtype=False)  # dtypes are cast per tensor
    if problems:
        raise ValueError("trainer and sampler parameters differ; nothing copied:\n  " + "\n  ".join(problems))
    src: dict[Any, Any] = dict(nnx.to_flat_state(params))
    dst: dict[Any, Any] = dict(nnx.to_flat_state(sampler.params))
    sampler_devices = set().union(*(v.get_value().sharding.device_set for v in dst.values()))
    baseline = _live_bytes(sampler_devices) if measure_memory else 0
    peak = 0
    total = 0
    keys = list(src)
    plan = plan_chunks([(k, src[k].get_value().nbytes) for k in keys], chunk_bytes, max_tensors)
    for chunk in plan:
        values = [src[k].get_value() for k in chunk]
        targets = [dst[k].get_value().sharding for k in chunk]
        moved = jax.block_until_ready(jax.device_put(values, targets, may_alias=False))
        if measure_memory:
            peak = max(peak, _live_bytes(sampler_devices) - baseline)
        for k, new in zip(chunk, moved):
            old = dst[k].get_value()
            dst[k] = dst[k].replace(new if new.dtype == old.dtype else new.astype(old.dtype))
            old.delete()  # the sampler's previous copy goes as soon as its replacement exists
            total += new.nbytes
    sampler.update_weights(nnx.from_flat_state(dst), version)
    stats = SyncStats(sampler.policy_version, total, time.perf_counter() - start, len(plan), peak)
    print(stats.line(), flush=True)
    return stats


# ------------------------------------------------------------ JAX -> vLLM


def hf_chunks(
    params: nnx.State, cfg: ModelConfig, chunk_bytes: int, max_tensors: int | None = None, dtype: Any | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Chunks of {HF name: host array in HF layout}, gathered one tensor (one layer) at a time."""
    tensors = hf_tensors(params, cfg)
    if dtype is not None:
        tensors = ((name, value.astype(dtype)) for name, value in tensors)
    for group in group_by_bytes(tensors, lambda item: item[1].nbytes, chunk_bytes, max_tensors):
        yield dict(group)


def sync_to_vllm(
    params: nnx.State,
    cfg: ModelConfig,
    sampler: Any,
    chunk_bytes: int,
    version: int | None = None,
    max_tensors: int | None = None,
    dtype: Any | None = None,
) -> SyncStats:
    """Stream trainer `params` to a vLLM sampler (`RemoteVLLMSampler` or in-process `VLLMSampler`).

    In a trainer process group (`core.distributed`) every process calls it: each tensor is gathered from the
    processes that hold its shards (a collective), and the first process sends the chunks; the others take part
    in the gathers and send nothing. A sampler that fails mid-sync still gets the group through the remaining
    gathers first, so that the processes stay in step for the next call."""
    start = time.perf_counter()
    counted = _Counted(hf_chunks(params, cfg, chunk_bytes, max_tensors, dtype))
    if not is_primary():
        counted.drain()
        return SyncStats(version or 0, counted.bytes, time.perf_counter() - start, counted.n)
    try:
        info = sampler.update_weights(counted, version)
    except BaseException:
        if jax.process_count() > 1:
            counted.drain()
        raise
    phases = {k: v for k, v in info.items() if k.endswith("_s")} or None
    stats = SyncStats(info["version"], info["bytes"], time.perf_counter() - start, counted.n, phases=phases)
    print(stats.line(), flush=True)
    return stats


class _Counted:
    """An iterable that counts what it yields (the number of chunks sent)."""

    def __init__(self, items):
        self.items, self.n, self.bytes = iter(items), 0, 0

    def __iter__(self):
        for item in self.items:
            self.n += 1
            self.bytes += sum(v.nbytes for v in item.values())
            yield item

    def drain(self) -> None:
        """Run through what is left (a process group's gathers), keeping nothing."""
        for _ in self:
            pass
