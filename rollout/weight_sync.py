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
- `sync_to_vllm`: to a vLLM actor. Each trainer process reads the shards its
  own devices hold (one replica each, cut into layers: `core.hf.pieces`), groups
  them into chunks and streams them through the Ray object store into the
  actor's reusable receive buffers; nothing is gathered between processes or
  through the driver. The actor puts each tensor together, converts it to the
  Hugging Face layout (`core.hf.layout`) and loads only a complete set.

Every sync bumps the policy version and returns (and logs) its bytes and time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from core.config import ModelConfig
from core.distributed import any_process, is_primary
from core.hf.pieces import TensorPiece, local_pieces
from core.models import state_mismatches

T = TypeVar("T")


@dataclass
class SyncStats:
    version: int
    bytes: int
    seconds: float
    chunks: int
    peak_extra_bytes: int = 0
    phases: dict | None = None  # seconds per phase (prepare: read + cast, transfer, commit)

    @staticmethod
    def combine(parts: Sequence[SyncStats]) -> SyncStats:
        """One sync made of several processes' parts: bytes and chunks summed, the slowest part's time and
        phases."""
        slowest = max(parts, key=lambda p: p.seconds)
        return SyncStats(
            parts[0].version,
            sum(p.bytes for p in parts),
            slowest.seconds,
            sum(p.chunks for p in parts),
            phases=slowest.phases,
        )

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
    partial: bool = False,
) -> SyncStats:
    """Copy trainer `params` into a `JaxSampler`'s shardings chunk by chunk, freeing its old buffers; with
    `partial`, `params` is part of the sampler's state (a policy's LoRA adapters: its base never changes) and the
    rest stays as it is.

    With `measure_memory`, `peak_extra_bytes` is the most memory the sync held on
    the sampler's devices beyond the sampler's own weights (a debugging aid:
    it walks all live arrays after every chunk).
    """
    start = time.perf_counter()
    expected = sampler.params
    if partial:  # only the given paths are compared (and replaced)
        wanted = {path for path, _ in nnx.to_flat_state(params)}
        expected = nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(sampler.params) if p in wanted])
    problems = state_mismatches(expected, params, check_dtype=False)  # dtypes are cast per tensor
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


# ------------------------------------------------------------ the policy, whichever sampler


def sync_policy(
    model: Any,
    sampler: Any,
    chunk_bytes: int,
    version: int,
    lora_sync: str = "adapters",
    base: str | None = None,
    tag: str | None = None,
) -> SyncStats:
    """The trainer's policy `model` (a `Decoder`, maybe with LoRA adapters) to `sampler`, the way its kind and
    `rollout.lora_sync` ask: to a vLLM sampler, a LoRA policy's adapters alone (`lora_sync="adapters"`: the engine
    serves its base; `base` names it in their config) or, like a policy without adapters, its weights (merged);
    to a JAX sampler, which holds the base since it started, the adapters' arrays, else every weight."""
    from core.models.adapters import merged_model

    lora = model.cfg.lora is not None
    if sampler.remote:  # a vLLM actor
        if lora and lora_sync == "adapters":
            return sync_adapters_to_vllm(model, sampler, version, base=base)
        plain = merged_model(model)  # every process sends the pieces its devices hold
        return sync_to_vllm(nnx.state(plain), plain.cfg, sampler, chunk_bytes, version=version, tag=tag or None)
    if lora:
        adapters = nnx.state(model, nnx.LoRAParam)
        return reshard_to_jax_sampler(adapters, sampler, chunk_bytes, version=version, partial=True)
    return reshard_to_jax_sampler(nnx.state(model), sampler, chunk_bytes, version=version)


# ------------------------------------------------------------ JAX -> vLLM


def sync_adapters_to_vllm(model: Any, sampler: Any, version: int | None = None, base: str | None = None) -> SyncStats:
    """A LoRA policy's adapters alone to a vLLM sampler serving its base (`VLLMSampler.load_adapter`): gathered to
    the host (in a trainer process group every process takes part) and sent by the first process, which commits
    them; the others report no bytes."""
    from core.hf.peft import adapter_config, adapter_tensors

    start = time.perf_counter()
    tensors = adapter_tensors(model)  # a collective in a process group
    nbytes, phases = 0, None
    if is_primary():
        info = sampler.load_adapter(tensors, adapter_config(model.cfg.lora, base), version)
        nbytes = int(sum(v.nbytes for v in tensors.values()))
        phases = {"commit_s": float(info.get("commit_s", 0.0))}
    done = version if version is not None else sampler.policy_version
    stats = SyncStats(done, nbytes, time.perf_counter() - start, 1 if nbytes else 0, phases=phases)
    if jax.process_count() == 1:
        print(stats.line() + " (LoRA adapters)", flush=True)
    return stats


def piece_chunks(
    params: nnx.State, cfg: ModelConfig, chunk_bytes: int, max_tensors: int | None = None, dtype: Any | None = None
) -> Iterator[list[TensorPiece]]:
    """Chunks of the tensor pieces this process's devices hold (`core.hf.pieces.local_pieces`), each of at most
    `chunk_bytes` (a bigger piece travels alone) and `max_tensors` pieces."""
    yield from group_by_bytes(local_pieces(params, cfg, dtype), lambda p: p.data.nbytes, chunk_bytes, max_tensors)


def sync_to_vllm(
    params: nnx.State,
    cfg: ModelConfig,
    sampler: Any,
    chunk_bytes: int,
    version: int | None = None,
    max_tensors: int | None = None,
    dtype: Any | None = None,
    tag: str | None = None,
) -> SyncStats:
    """Stream trainer `params` to a vLLM sampler (`RemoteVLLMSampler` or in-process `VLLMSampler`): this process
    sends the pieces its devices hold, in chunks of at most `chunk_bytes`; the sampler loads them once all arrived.

    In a trainer process group (`core.distributed`) every process calls it with the same `tag` (the update's
    name): each sends its own pieces straight to the sampler, with no gather between processes; once all have
    sent, the first process commits. A process whose sending fails raises its error and the others return without
    a commit (they learn it from one small collective), so that the group stays in step for the next call. The
    stats are this process's part (bytes it sent)."""
    start = time.perf_counter()
    tag = tag or uuid.uuid4().hex
    chunks = _Counted(piece_chunks(params, cfg, chunk_bytes, max_tensors, dtype))
    error: Exception | None = None
    info: dict = {}
    try:
        info = sampler.send_pieces(chunks, tag)
    except Exception as err:
        error = err
    if any_process(error is not None):  # every process takes part, so none waits on the others
        if error is not None:
            raise error
        # Another process failed to send: nothing is committed; its error is the one the driver sees.
        return SyncStats(version or 0, chunks.bytes, time.perf_counter() - start, chunks.n)
    if is_primary():
        info.update(sampler.commit_weights(tag, version) or {})
    phases = {k: v for k, v in info.items() if k.endswith("_s")} or None
    done = version if version is not None else sampler.policy_version
    stats = SyncStats(done, chunks.bytes, time.perf_counter() - start, chunks.n, phases=phases)
    if jax.process_count() == 1:
        print(stats.line(), flush=True)
    return stats


class _Counted:
    """An iterable of piece chunks that counts what it yields (chunks and bytes sent)."""

    def __init__(self, items: Iterable[list[TensorPiece]]):
        self.items, self.n, self.bytes = iter(items), 0, 0

    def __iter__(self):
        for item in self.items:
            self.n += 1
            self.bytes += sum(p.data.nbytes for p in item)
            yield item
