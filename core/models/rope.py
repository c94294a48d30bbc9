"""Rotary position embeddings in the Hugging Face "rotate half" convention, with Llama 3.1 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from core.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """inv_freq [H/2] in float32, scaled per `cfg.rope_scaling` (computed once, on the host)."""
    dim = cfg.resolved_head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if sc.rope_type == "linear":
        return (inv / sc.factor).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old = sc.original_max_position_embeddings
    low_wavelen = old / sc.low_freq_factor
    high_wavelen = old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | tuple[float, ...]) -> jax.Array:
    """x [B, T, N, H], positions [B, T] -> x rotated; angles in float32, result in x's dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
