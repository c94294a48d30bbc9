"""Hugging Face tensors in pieces: what one process's devices hold of each, and the tensors put back together.

    for piece in local_pieces(params, cfg):      # on every trainer process: its own shards, no collective
        send(piece)                              # TensorPiece(hf_name, start, data), core layout
    assembler = TensorAssembler(cfg)             # on the receiver (a vLLM sampler)
    assembler.add(pieces, tag)                   # from any process, in any order; a new tag starts over
    assembler.check(tag)                         # every element of every tensor arrived, once
    for name, value in assembler.hf_tensors():   # whole tensors in HF layout
        ...

A parameter sharded over the devices of several processes is never gathered for a weight sync: each process reads
the shards its own devices hold (`jax.Array.addressable_shards`), keeps one replica of each (`replica_id == 0`, so
every element is sent once by the whole group), cuts a stacked parameter into its layers, and sends those pieces
in the core layout. The receiver writes each piece at its place in a buffer of the layer's core shape and converts
the whole buffer to the Hugging Face layout (`core.hf.layout`) when it loads it: a shard of a `[D, N, H]` kernel
is a block of the core tensor but not, after the transpose, of the Hugging Face one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from flax import nnx

from core.config import ModelConfig
from core.errors import TemperError
from core.hf.layout import ParamMapping, param_map
from core.models.build import abstract_model


class WeightUpdateError(TemperError, ValueError):
    """Pieces that do not make the served model's tensors; the receiver still serves the previous weights."""


@dataclass(frozen=True)
class TensorPiece:
    """A block of one Hugging Face tensor in the core layout (one layer of a stacked parameter): `data` sits at
    index `start` of the tensor's core-layout value."""

    name: str
    start: tuple[int, ...]
    data: np.ndarray


def local_pieces(params: nnx.State, cfg: ModelConfig, dtype: Any | None = None) -> Iterator[TensorPiece]:
    """The pieces of every tensor that this process's devices hold (one replica of each shard), parameter by
    parameter, so that host memory holds one parameter's local shards at a time. No collective: every process
    calls it on its own, and the group's pieces together cover every tensor exactly once."""
    flat = dict(nnx.to_flat_state(params))
    by_path: dict[tuple, list[ParamMapping]] = {}
    for m in param_map(cfg):
        by_path.setdefault(m.core_path, []).append(m)
    for path, mappings in by_path.items():
        value = flat[path].get_value()
        shards = [(s.index, np.asarray(s.data)) for s in value.addressable_shards if s.replica_id == 0]
        for m in mappings:
            for index, data in shards:
                starts = [sl.indices(n)[0] for sl, n in zip(index, value.shape, strict=True)]
                stops = [sl.indices(n)[1] for sl, n in zip(index, value.shape, strict=True)]
                # A stacked parameter (layers, experts): the part of the shard at this tensor's index, if it has it.
                lead = len(m.index)
                if not all(a <= i < b for i, a, b in zip(m.index, starts, stops, strict=False)):
                    continue
                data = data[tuple(i - a for i, a in zip(m.index, starts, strict=False))] if lead else data
                piece = TensorPiece(m.hf_name, tuple(starts[lead:]), data if dtype is None else data.astype(dtype))
                yield piece


def core_layouts(cfg: ModelConfig) -> dict[str, tuple[ParamMapping, tuple[int, ...]]]:
    """HF name -> (its mapping, its core-layout shape: its part of a stacked parameter)."""
    flat = dict(nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)))
    out = {}
    for m in param_map(cfg):
        shape = tuple(flat[m.core_path].shape)
        out[m.hf_name] = (m, shape[len(m.index) :])
    return out


class TensorAssembler:
    """Receive buffers for one model's tensors (kept between updates), filled piece by piece from any number of
    senders; `check` says whether every element arrived exactly once, `hf_tensors` reads them whole."""

    def __init__(self, cfg: ModelConfig):
        self.layouts = core_layouts(cfg)
        self._buffers: dict[str, np.ndarray] = {}
        self._blocks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}  # name -> (start, stop)s
        self.tag: Any = None  # which update the buffers hold pieces of

    def add(self, pieces: Iterable[TensorPiece], tag: Any) -> int:
        """Write `pieces` into the buffers; returns their bytes. Pieces of another update than the last (`tag`)
        start the buffers over. A piece that is not part of the model raises `WeightUpdateError` (and drops what
        this update received so far), and so does one that overlaps a piece this update already brought: with
        that excluded, pieces adding up to a tensor's size cover it exactly."""
        if tag != self.tag:
            self.tag, self._blocks = tag, {}
        nbytes = 0
        for p in pieces:
            layout = self.layouts.get(p.name)
            region = _region(p, layout[1]) if layout is not None else None
            problem = _not_part(p, layout) if region is None else self._overlap(p)
            if problem:
                self._blocks = {}
                raise WeightUpdateError(f"weight update rejected, previous weights kept: {problem}")
            buf = self._buffers.get(p.name)
            if buf is None or buf.dtype != p.data.dtype:
                buf = self._buffers[p.name] = np.empty(layout[1], p.data.dtype)  # type: ignore[index]
            buf[region] = p.data
            stop = tuple(s + n for s, n in zip(p.start, p.data.shape, strict=True))
            self._blocks.setdefault(p.name, []).append((p.start, stop))
            nbytes += p.data.nbytes
        return nbytes

    def _overlap(self, p: TensorPiece) -> str:
        """What is wrong when `p` overlaps a block of its tensor received before in this update ("" if nothing)."""
        blocks = self._blocks.get(p.name)
        if not blocks:
            return ""
        lo, hi = (np.array(side) for side in zip(*blocks, strict=True))  # [blocks, ndim] each
        start = np.array(p.start)
        stop = start + np.array(p.data.shape)
        hit = np.flatnonzero(np.all((lo < stop) & (start < hi), axis=1))
        if not len(hit):
            return ""
        before = blocks[hit[0]][0]
        return f"{p.name}: the block at {p.start} of shape {p.data.shape} overlaps one received before at {before}"

    def problems(self) -> list[str]:
        """What keeps the received pieces from being the whole model: tensors missing or part-filled."""
        out = []
        for name, (_, shape) in self.layouts.items():
            blocks = self._blocks.get(name, [])
            size = int(np.prod(shape))
            got = sum(int(np.prod(np.subtract(stop, start))) for start, stop in blocks)
            if got != size:
                out.append(f"{name}: {'missing' if got == 0 else f'{got} of {size} elements received'}")
        return out

    def check(self, tag: Any) -> None:
        """Raise `WeightUpdateError` unless every element of every tensor of update `tag` arrived, once. Either
        way the next update starts over."""
        problems = self.problems() if tag == self.tag else ["no piece of this update arrived"]
        self._blocks, self.tag = {}, None
        if problems:
            raise WeightUpdateError(
                f"weight update incomplete, previous weights kept: {len(problems)} tensor(s) wrong: "
                + "; ".join(problems[:20])
            )

    def hf_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, value in HF layout) of every tensor, one converted at a time (after `check`)."""
        for name, (mapping, _) in self.layouts.items():
            yield name, np.ascontiguousarray(mapping.layer_to_hf(self._buffers[name]))


def _region(piece: TensorPiece, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """Where `piece` goes in a tensor of core shape `shape`, or None when it does not fit there."""
    if len(piece.start) != len(shape) or piece.data.ndim != len(shape):
        return None
    if any(s < 0 or s + n > full for s, n, full in zip(piece.start, piece.data.shape, shape, strict=True)):
        return None
    return tuple(slice(s, s + n) for s, n in zip(piece.start, piece.data.shape, strict=True))


def _not_part(piece: TensorPiece, layout: tuple[ParamMapping, tuple[int, ...]] | None) -> str:
    if layout is None:
        return f"unexpected tensor {piece.name}; the trainer's model is not the served one"
    return (
        f"{piece.name}: a block of shape {piece.data.shape} at {piece.start} does not fit core shape {layout[1]}; "
        "the trainer's model is not the served one"
    )
