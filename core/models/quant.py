"""A frozen projection kernel stored quantized (QLoRA's base): int8 per output channel, or 4-bit NormalFloat.

    stored = quantize_kernel(w, in_axes=1, kind="nf4", block=64)   # {"q": uint8 [I/2, O], "scale": [I/64, O]}
    w_hat = dequantize_kernel(stored, w.shape, in_axes=1, kind="nf4", block=64)   # float32, w's shape

The quantization itself is qwix's (`qwix.quantize` / `qwix.dequantize`, the library Tunix quantizes with): a kernel
`[*in, *out]` is seen as a matrix `[I, O]` (I the product of its input axes, O of its output axes); int8 takes one
absmax scale per output column (bitsandbytes' LLM.int8 weight layout), NF4 one absmax scale per block of `block`
consecutive input elements of a column (QLoRA's NormalFloat-4, Dettmers et al., 2023) and its 4-bit codes are
stored two to a byte, so the frozen base takes 1 byte (int8) or half a byte (NF4) per weight plus its scales. A
leading `layers` axis (scanned layers) is kept, each layer quantized on its own. `Quantized` variables are neither
`nnx.Param`s nor trained: they are the frozen part of the module tree (`core.train.split_modules`).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

QuantKind = Literal["int8", "nf4"]


class Quantized(nnx.Variable):
    """A quantized kernel's codes or scales (never a trainable parameter)."""


def check_block(in_size: int, block: int, where: str) -> None:
    if in_size % block:
        raise ValueError(
            f"{where}: {in_size} input elements are not divisible by model.lora.quant_block_size={block} (NF4 blocks)"
        )


def quantize_kernel(w: jax.Array, in_axes: int, kind: QuantKind, block: int, layered: bool = False) -> dict:
    """{"q": codes, "scale": scales} of kernel `w` whose first `in_axes` axes (after the `layers` axis when
    `layered`) are its input axes."""
    import qwix

    lead = 1 if layered else 0
    shape = w.shape
    i = math.prod(shape[lead : lead + in_axes])
    o = math.prod(shape[lead + in_axes :])
    m = w.astype(jnp.float32).reshape(*shape[:lead], i, o)  # [(L,) I, O]
    channels = (*range(lead), lead + 1)  # each layer and output column on its own
    if kind == "int8":
        qa = qwix.quantize(m, jnp.int8, channelwise_axes=channels)
        return {"q": qa.qvalue, "scale": qa.scale}
    check_block(i, block, "NF4")
    qa = qwix.quantize(m, "nf4", channelwise_axes=channels, tiled_axes={lead: block})
    codes = qa.qvalue.astype(jnp.uint8)  # [(L,) I, O], values 0..15
    pairs = codes.reshape(*shape[:lead], i // 2, 2, o)
    return {"q": pairs[..., 0, :] | (pairs[..., 1, :] << 4), "scale": qa.scale}


def dequantize_kernel(stored: dict, shape: tuple[int, ...], in_axes: int, kind: QuantKind, layered: bool = False):
    """The float32 kernel of `shape` that `quantize_kernel` stored."""
    import qwix
    from qwix import QArray

    lead = 1 if layered else 0
    i = math.prod(shape[lead : lead + in_axes])
    o = math.prod(shape[lead + in_axes :])
    q, scale = stored["q"], stored["scale"]
    if kind == "int8":
        m = qwix.dequantize(QArray(q, scale, None, jnp.int8))
    else:
        codes = jnp.stack([q & 15, q >> 4], axis=lead + 1).reshape(*shape[:lead], i, o)
        m = qwix.dequantize(QArray(codes.astype(jnp.uint4), scale, None, "nf4"))
    return m.astype(jnp.float32).reshape(shape)
