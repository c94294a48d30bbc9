"""LoRA adapters of the decoder's projections (Hu et al., 2021), in PEFT's layout and scaling.

    adapter = LoRA("MD,DNH->MNH", kernel_shape=(D, N, H), axes=("embed", "heads", "head_dim"), lora=cfg, rngs)
    y = x @ W + adapter(x, rng)          # (alpha / r) * dropout(x) A B, or alpha / sqrt(r) with rsLoRA
    trainable_filter(model_cfg)          # nnx.LoRAParam with model.lora, else nnx.Param: what a learner trains

A projection `einsum(eq, x, W)` with `W [*in, *out]` (its input axes are those `x` shares with it) gets
`A [*in, r]` and `B [r, *out]`, both `nnx.LoRAParam`s: PEFT's `lora_A.weight [r, in]` and `lora_B.weight
[out, r]` are `A` and `B` flattened and transposed (`core.hf.peft`). B starts at zero, so the adapted model starts as
its base; A starts as PEFT's (Kaiming uniform with bound 1/sqrt(fan_in), or normal with std 1/r for
`init=gaussian`). Dropout (`model.lora.dropout`) applies to the adapter's input only, as PEFT's does, and only
where the loss passes a key (training; never in scoring or sampling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import LoraConfig, ModelConfig

RANK = "R"  # the rank's letter in the adapter's einsums (no projection uses it)


def trainable_filter(cfg: ModelConfig):
    """What trains in a model of this config: its LoRA adapters when it has them, else every parameter."""
    return nnx.LoRAParam if cfg.lora is not None else nnx.Param


def split_letters(eq: str) -> tuple[str, str, str]:
    """(x's letters, the kernel's input letters, its output letters) of a flattened projection `M...,...->M...`;
    the kernel must list its input letters first."""
    lhs, _ = eq.split("->")
    x, kernel = lhs.split(",")
    inputs = "".join(c for c in kernel if c in x)
    outputs = "".join(c for c in kernel if c not in x)
    if kernel != inputs + outputs or RANK in eq:
        raise ValueError(f"a LoRA adapter needs a kernel laid out [*in, *out] without {RANK!r}, not {eq!r}")
    return x, inputs, outputs


def lora_init(key: jax.Array, shape: Sequence[int], fan_in: int, cfg: LoraConfig, dtype=jnp.float32) -> jax.Array:
    """A's initial value: PEFT's Kaiming uniform (`nn.init.kaiming_uniform_(a=sqrt(5))`: bound 1/sqrt(fan_in)) or
    normal with std 1/r (`init_lora_weights="gaussian"`)."""
    if cfg.init == "gaussian":
        return (jax.random.normal(key, shape, jnp.float32) / cfg.rank).astype(dtype)
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


class LoRA(nnx.Module):
    """The low-rank update of one projection: `scale * (dropout(x) A) B`."""

    def __init__(
        self,
        eq: str,
        kernel_shape: Sequence[int],
        axes: Sequence[str],
        lora: LoraConfig,
        rngs: nnx.Rngs,
        dtype: jnp.dtype,
    ):
        x, inputs, outputs = split_letters(eq)
        n_in = len(inputs)
        in_shape, out_shape = tuple(kernel_shape[:n_in]), tuple(kernel_shape[n_in:])
        r = lora.rank
        self.a = nnx.LoRAParam(
            lora_init(rngs.params(), (*in_shape, r), math.prod(in_shape), lora),
            logical_axes=(*axes[:n_in], "lora_rank"),
        )
        self.b = nnx.LoRAParam(jnp.zeros((r, *out_shape), jnp.float32), logical_axes=("lora_rank", *axes[n_in:]))
        self.down = f"{x},{inputs}{RANK}->{x.replace(inputs, '')}{RANK}"  # e.g. "MD,DR->MR"
        self.up = f"{x.replace(inputs, '')}{RANK},{RANK}{outputs}->{x.replace(inputs, '')}{outputs}"
        self.n_in = n_in
        self.scale = lora.scale
        self.dropout = lora.dropout
        self.dtype = dtype

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """The update for `x` (flattened tokens first: `[M, *in]` -> `[M, *out]`)."""
        if self.dropout > 0 and rng is not None:
            keep = jax.random.bernoulli(rng, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        h = jnp.einsum(self.down, x, self.a[...].astype(self.dtype))
        return jnp.einsum(self.up, h, self.b[...].astype(self.dtype)) * jnp.asarray(self.scale, self.dtype)

    def delta(self) -> jax.Array:
        """`scale * A B` in the kernel's layout `[(L,) *in, *out]` (float32): what merging adds to the base (a
        stacked adapter, with a leading `layers` axis, gives one per layer)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        lead = a.ndim - self.n_in - 1
        r, layers = a.shape[-1], a.shape[:lead]
        merged = jnp.einsum("...ir,...ro->...io", a.reshape(*layers, -1, r), b.reshape(*layers, r, -1))
        return (merged * self.scale).reshape(*a.shape[:-1], *b.shape[lead + 1 :])
