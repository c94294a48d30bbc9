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
    """A projection `einsum(eq, x, kernel) (+ bias)` whose kernel shape is spelled out by its logical axes."""

    def __init__(
        self,
        eq: str,
        shape: Sequence[int],
        axes: Sequence[str],
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        bias_axes: Sequence[str] | None = None,
        fan_in: int | None = None,
    ):
        pd = dtype_of(cfg.param_dtype)
        if not (eq.startswith("BT") and "->BT" in eq) or "M" in eq:
            raise ValueError(f"Dense einsum {eq!r} must map [B, T, ...] to [B, T, ...] and not use 'M'")
        self.eq = eq
        self.dtype = dtype_of(cfg.dtype)
        self.kernel = param(rngs, shape, axes, pd, fan_in=fan_in)
        bias = None
        if bias_axes is not None:
            bias_shape = [shape[list(axes).index(a)] for a in bias_axes]
            bias = param(rngs, bias_shape, bias_axes, pd, init="zeros")
        self.bias = nnx.data(bias)  # optional parameter: declared as data even when None

    def __call__(self, x: jax.Array) -> jax.Array:
        # Tokens are flattened to one axis M = B*T first ("BTD" -> "MD"): XLA:CPU runs the
        # backward of an einsum with two token axes about 2x slower than the same 2-D matmul.
        lead = x.shape[:2]
        eq = self.eq.replace("BT", "M")
        y = jnp.einsum(eq, x.reshape(-1, *x.shape[2:]), self.kernel[...].astype(self.dtype))
        y = y.reshape(*lead, *y.shape[1:])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Dense("BTD,DF->BTF", (d, f), ("embed", "mlp"), cfg, rngs)
        self.up_proj = Dense("BTD,DF->BTF", (d, f), ("embed", "mlp"), cfg, rngs)
        self.down_proj = Dense("BTF,FD->BTD", (f, d), ("mlp", "embed"), cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D]
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)  # [B, T, F]
        return self.down_proj(constrain(h, ("batch", "length", "act_mlp")))
