"""Building blocks of the decoder: parameters with logical axes, RMSNorm, embeddings, MLP.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata; shardings are
derived from it by `core.mesh` (the model never names a mesh axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import ModelConfig
from core.mesh import constrain
from core.models.lora import LoRA, split_letters
from core.models.quant import Quantized, dequantize_kernel, quantize_kernel


def dtype_of(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: jnp.dtype,
    init: str = "normal",
    fan_in: int | None = None,
) -> nnx.Param:
    """A parameter with logical axis names. `normal` is scaled by 1/sqrt(fan_in); `ones`/`zeros` as named."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        std = (fan_in or shape[0]) ** -0.5
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    """y = scale * x / rms(x), normalised in float32, scaled in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float, param_dtype: jnp.dtype, rngs: nnx.Rngs, axis_name="norm"):
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * xf.astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embedding = param(
            # std 1/sqrt(D): with tied embeddings the initial logits then have unit scale
            rngs,
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            dtype_of(cfg.param_dtype),
            fan_in=cfg.hidden_size,
        )
        self.dtype = dtype_of(cfg.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class Dense(nnx.Module):
    """A projection `einsum(eq, x, kernel) (+ bias)` whose kernel shape is spelled out by its logical axes.

    `name` is its Hugging Face name (`q_proj`, ..., `down_proj`): with `model.lora` naming it, it gets a LoRA
    adapter (`core.models.lora`); with `model.lora.quantize_base`, every named projection's kernel is stored
    quantized and frozen (`core.models.quant`: QLoRA's base), dequantized here in the forward pass."""

    def __init__(
        self,
        eq: str,
        shape: Sequence[int],
        axes: Sequence[str],
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        bias_axes: Sequence[str] | None = None,
        fan_in: int | None = None,
        name: str | None = None,
    ):
        pd = dtype_of(cfg.param_dtype)
        if not (eq.startswith("BT") and "->BT" in eq) or "M" in eq:
            raise ValueError(f"Dense einsum {eq!r} must map [B, T, ...] to [B, T, ...] and not use 'M'")
        self.eq = eq
        self.shape = tuple(shape)
        self.dtype = dtype_of(cfg.dtype)
        flat_eq = eq.replace("BT", "M")
        lora = cfg.lora if name is not None else None
        self.quant = lora.quantize_base if lora is not None else "none"
        self.in_axes = len(split_letters(flat_eq)[1])  # the kernel's input axes ([*in, *out])
        self.block = lora.quant_block_size if lora is not None else 0
        kernel = param(rngs, shape, axes, pd, fan_in=fan_in)
        self.kernel = nnx.data(None if self.quant != "none" else kernel)
        self.kernel_q = nnx.data(None)
        self.kernel_scale = nnx.data(None)
        if self.quant != "none":  # QLoRA: the frozen base stored quantized (its float value is not kept)
            stored = quantize_kernel(kernel[...], self.in_axes, self.quant, self.block)
            flat_axes = (axes[0], axes[self.in_axes])  # [I, O]: the first input and the first output axis's names
            self.kernel_q = nnx.data(Quantized(stored["q"], logical_axes=flat_axes))
            self.kernel_scale = nnx.data(Quantized(stored["scale"], logical_axes=flat_axes))
        bias = None
        if bias_axes is not None:
            bias_shape = [shape[list(axes).index(a)] for a in bias_axes]
            bias = param(rngs, bias_shape, bias_axes, pd, init="zeros")
        self.bias = nnx.data(bias)  # optional parameter: declared as data even when None
        adapter = None
        if lora is not None and name in lora.target_modules:
            adapter = LoRA(flat_eq, shape, axes, lora, rngs, self.dtype)
        self.lora = nnx.data(adapter)

    def weight(self) -> jax.Array:
        """The kernel `[*in, *out]` in the compute dtype (dequantized when stored quantized)."""
        if self.kernel is not None:
            return self.kernel[...].astype(self.dtype)
        assert self.kernel_q is not None and self.kernel_scale is not None
        # One layer's parameters: scanned layers are sliced before a layer is called.
        stored = {"q": self.kernel_q[...], "scale": self.kernel_scale[...]}
        return dequantize_kernel(stored, self.shape, self.in_axes, self.quant).astype(self.dtype)  # type: ignore[arg-type]

    def adapter(self, x_flat: jax.Array, rng: jax.Array | None = None) -> jax.Array | None:
        """The LoRA update of flattened tokens `x_flat` `[M, *in]` -> `[M, *out]`, or None without an adapter."""
        return None if self.lora is None else self.lora(x_flat, rng)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        # Tokens are flattened to one axis M = B*T first ("BTD" -> "MD"): XLA:CPU runs the
        # backward of an einsum with two token axes about 2x slower than the same 2-D matmul.
        lead = x.shape[:2]
        flat = x.reshape(-1, *x.shape[2:])
        y = jnp.einsum(self.eq.replace("BT", "M"), flat, self.weight())
        update = self.adapter(flat, rng)
        if update is not None:
            y = y + update
        y = y.reshape(*lead, *y.shape[1:])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def fold(rng: jax.Array | None, i: int) -> jax.Array | None:
    """A key of its own for part `i` of a layer (None stays None: no dropout)."""
    return None if rng is None else jax.random.fold_in(rng, i)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Dense("BTD,DF->BTF", (d, f), ("embed", "mlp"), cfg, rngs, name="gate_proj")
        self.up_proj = Dense("BTD,DF->BTF", (d, f), ("embed", "mlp"), cfg, rngs, name="up_proj")
        self.down_proj = Dense("BTF,FD->BTD", (f, d), ("mlp", "embed"), cfg, rngs, name="down_proj")

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:  # [B, T, D]
        h = jax.nn.silu(self.gate_proj(x, fold(rng, 0))) * self.up_proj(x, fold(rng, 1))  # [B, T, F]
        return self.down_proj(constrain(h, ("batch", "length", "act_mlp")), fold(rng, 2))
