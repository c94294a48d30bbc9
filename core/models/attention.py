"""The attention block: q/k/v projections (optional biases, optional q/k RMSNorm), RoPE, GQA, output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import ModelConfig
from core.kernels.attention import attention, cached_step
from core.mesh import constrain
from core.models.compact import Compaction
from core.models.layers import Dense, RMSNorm, dtype_of, fold
from core.models.rope import apply_rope, inverse_frequencies


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        bias = ("heads", "head_dim") if cfg.attention_bias else None
        kv_bias = ("kv_heads", "head_dim") if cfg.attention_bias else None
        self.q_proj = Dense("BTD,DNH->BTNH", (d, n, h), ("embed", "heads", "head_dim"), cfg, rngs, bias, name="q_proj")
        self.k_proj = Dense(
            "BTD,DKH->BTKH", (d, k, h), ("embed", "kv_heads", "head_dim"), cfg, rngs, kv_bias, name="k_proj"
        )
        self.v_proj = Dense(
            "BTD,DKH->BTKH", (d, k, h), ("embed", "kv_heads", "head_dim"), cfg, rngs, kv_bias, name="v_proj"
        )
        self.o_proj = Dense(
            "BTNH,NHD->BTD", (n, h, d), ("heads", "head_dim", "embed"), cfg, rngs, fan_in=n * h, name="o_proj"
        )
        pd = dtype_of(cfg.param_dtype)
        norm = lambda: RMSNorm(h, cfg.rms_norm_eps, pd, rngs, axis_name="head_dim")
        self.q_norm = nnx.data(norm() if cfg.qk_norm else None)
        self.k_norm = nnx.data(norm() if cfg.qk_norm else None)
        # Static (hashable) data, not a parameter: the frequencies are a function of the config.
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(cfg))
        self.impl = cfg.attention_impl

    def project_qkv(self, x: jax.Array, rng: jax.Array | None = None):
        """q [B, T, N, H], k, v [B, T, K, H] from one fused matmul.

        The three kernels are concatenated at compute time ([D, (N + 2K) H], a
        cheap copy) so the CPU/GPU runs one wide matmul instead of three narrow
        ones; the parameters stay separate, in the Hugging Face split. LoRA
        updates (`core.models.lora`) are added per projection.
        """
        b, t, d = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj)
        heads = [p.shape[1] for p in projs]
        h = projs[0].shape[2]
        dt = self.q_proj.dtype
        w = jnp.concatenate([p.weight().reshape(d, -1) for p in projs], axis=1)
        flat = x.reshape(b * t, d)
        y = flat @ w  # [B*T, (N + 2K) H]
        if self.q_proj.bias is not None:
            y = y + jnp.concatenate([p.bias[...].reshape(-1).astype(dt) for p in projs])  # type: ignore[index]
        q, k, v = jnp.split(y, [heads[0] * h, (heads[0] + heads[1]) * h], axis=1)
        out = []
        for i, (z, p, n) in enumerate(zip((q, k, v), projs, heads)):
            update = p.adapter(flat, fold(rng, i))
            z = z.reshape(b * t, n, h)
            out.append((z if update is None else z + update).reshape(b, t, n, h))
        return tuple(out)

    def qkv(self, x: jax.Array, positions: jax.Array, rng: jax.Array | None = None):
        """Projected, normalised and rotated q [B, T, N, H], k, v [B, T, K, H]."""
        q, k, v = self.project_qkv(x, rng)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
        k = constrain(k, ("batch", "length", "act_kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
        return q, k, v

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        layout: Compaction | None = None,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, T, D] in the rows of `mask` [B, T, T], or the compact tokens [S, N, D] of `layout`
        (`core.models.compact`): attention then runs on q, k, v put back in the rows. `rng`: LoRA dropout's key
        (training only)."""
        q, k, v = self.qkv(x, positions, rng)
        if layout is not None:
            q, k, v = layout.to_rows(q), layout.to_rows(k), layout.to_rows(v)
        out = attention(q, k, v, mask, self.impl, causal=True)  # [B, T, N, H]; the mask is causal in row order
        if layout is not None:
            out = layout.to_compact(out)
        return self.o_proj(out, fold(rng, 3))

    def with_cache(self, x, positions, cache_k, cache_v, mask):
        """Attention against a KV cache whose slot index is the token position.

        x [B, T, D], positions [B, T]; cache_k/v [B, S, K, H]; mask [B, T, S].
        The new keys/values are written at their positions first, so a token
        also attends to itself. Returns (out [B, T, D], cache_k, cache_v).
        """
        q, k, v = self.qkv(x, positions)
        rows = jnp.arange(x.shape[0])[:, None]
        cache_k = cache_k.at[rows, positions].set(k.astype(cache_k.dtype))
        cache_v = cache_v.at[rows, positions].set(v.astype(cache_v.dtype))
        out = attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask, self.impl)
        return self.o_proj(out), cache_k, cache_v

    def decode_step(self, x, positions, cache_k, cache_v, mask):
        """One token a row (x [B, 1, D] at positions [B, 1]) against a KV cache it reads only (cache_k/v
        [B, S, K, H]; mask [B, 1, S]: the keys before each position): (out [B, 1, D], its key and value
        [B, 1, K, H], for the caller to write at `positions`)."""
        q, k, v = self.qkv(x, positions)
        out = cached_step(q, cache_k, cache_v, mask, k.astype(cache_k.dtype), v.astype(cache_v.dtype))
        return self.o_proj(out), k.astype(cache_k.dtype), v.astype(cache_v.dtype)
