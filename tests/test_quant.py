"""QLoRA's stored base (`core.models.quant`) against a NumPy reference of the formats: int8 with one scale per
output column, and NF4 (QLoRA's 16 NormalFloat levels, one absmax scale per block of input elements, two
codes a byte); each weight within half a level's gap of its value."""

import jax.numpy as jnp
import numpy as np
import pytest

from core.models.quant import dequantize_kernel, quantize_kernel

# Dettmers et al. 2023, appendix E: the NF4 levels (bitsandbytes' table).
NF4 = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    np.float64,
)  # fmt: skip


def numpy_nf4(m: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dequantized [I, O], absmax scales [I / block, O], near a tie [I, O]) of a matrix: each block of `block`
    consecutive input elements of a column scaled by its absmax and rounded to the nearest level."""
    i, o = m.shape
    blocks = m.reshape(i // block, block, o).astype(np.float64)
    scale = np.abs(blocks).max(axis=1, keepdims=True)
    distance = np.abs(blocks[..., None] / scale[..., None] - NF4)
    codes = distance.argmin(-1)
    two = np.sort(distance, -1)[..., :2]
    tie = (two[..., 1] - two[..., 0] < 1e-5).reshape(i, o)
    return (NF4[codes] * scale).reshape(i, o), scale[:, 0], tie


def numpy_int8(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dequantized, scales [O], near a tie): qwix's symmetric int8, whose top bucket spans [126.5, 127.5)
    (scale absmax / 127.5; codes -128..127, rounded half to even)."""
    scale = np.abs(m.astype(np.float64)).max(axis=0) / 127.5
    x = m / scale
    tie = np.abs(np.abs(x - np.floor(x)) - 0.5) < 1e-4  # a column's absmax sits on one: XLA may round it either way
    return np.clip(np.round(x), -128, 127) * scale, scale, tie


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize(
    "shape, in_axes, layered",
    [((64, 48), 1, False), ((3, 4, 16, 40), 2, True)],  # a [in, out] kernel; scanned [layers, heads, head_dim, out]
)
def test_stored_kernels_dequantize_to_the_numpy_reference(kind, shape, in_axes, layered):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0, shape[-1])).astype(np.float32)  # columns of any scale
    block = 16
    stored = quantize_kernel(jnp.asarray(w), in_axes, kind, block, layered)
    got = np.asarray(dequantize_kernel(stored, shape, in_axes, kind, layered))
    assert got.shape == w.shape and got.dtype == np.float32
    lead = 1 if layered else 0
    i = int(np.prod(shape[lead : lead + in_axes]))
    o = int(np.prod(shape[lead + in_axes :]))
    layers = w.reshape(-1, i, o)  # one matrix per layer
    for layer, (m, g) in enumerate(zip(layers, got.reshape(-1, i, o))):
        want, scale, tie = numpy_nf4(m, block) if kind == "nf4" else numpy_int8(m)
        steps = np.abs(g - want) / np.spacing(np.abs(want).astype(np.float32) + np.float32(1e-30))
        assert tie.mean() < 0.05 and steps[~tie].max() <= 4, (layer, steps.max())  # the levels, to float32 rounding
        # each weight within half the widest gap between levels (NF4: 0.152 of its block's absmax; int8: half a step)
        bound = np.repeat(scale, block, axis=0) * 0.1520 if kind == "nf4" else scale / 2
        assert (np.abs(g - m) <= bound * (1 + 1e-4)).all(), layer  # a tie: half a step, to float32 rounding
    # storage: int8 one byte a weight; NF4 two codes a byte, in uint8
    q = np.asarray(stored["q"])
    assert q.dtype == (np.int8 if kind == "int8" else np.uint8)
    assert q.size == (w.size if kind == "int8" else w.size // 2)
