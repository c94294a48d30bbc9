"""The decoder-only transformer shared by Llama 2/3/3.x, Qwen2/2.5, Qwen3 and Mistral.

The families differ only in config switches: q/k/v biases (Qwen2), q/k RMSNorm
and a free head_dim (Qwen3), RoPE scaling (Llama 3.1+), sliding window (Mistral
v0.1), tied embeddings. Layers are either a Python list or one stacked module
run under `jax.lax.scan` (`scan_layers`), optionally rematerialised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from core.config import ModelConfig
from core.kernels.attention import make_mask, window_mask
from core.mesh import constrain
from core.models.attention import Attention
from core.models.compact import Compaction
from core.models.layers import MLP, Dense, Embed, RMSNorm, dtype_of, fold
from core.models.moe import MoeBlock, RouterStats
from core.router_loss import record_router

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nnx.Module):
    """Attention and a feed-forward layer, each pre-normed and residual: the dense SwiGLU `MLP`, or with
    `sparse` the mixture of experts (`core.models.moe.MoeBlock`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False):
        pd = dtype_of(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.mlp: MLP | MoeBlock = MoeBlock(cfg, rngs) if sparse else MLP(cfg, rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        layout: Compaction | None = None,
        rng: jax.Array | None = None,
        valid: jax.Array | None = None,
        routes: jax.Array | None = None,
        replay: bool = False,
    ) -> tuple[jax.Array, RouterStats | None]:
        """(the residual stream after this layer, its router's stats over the tokens `valid` marks real, or None
        for a dense layer). `routes`, `replay`: a sampler's experts for each token (`MoeBlock`)."""
        x = x + self.attn(self.input_norm(x), positions, mask, layout, fold(rng, 0))
        h, stats, _ = self._feed_forward(self.post_attn_norm(x), fold(rng, 1), valid, routes, replay)
        return constrain(x + h, ("batch", "length", "act_embed")), stats

    def _feed_forward(self, x, rng=None, valid=None, routes=None, replay=False):
        """(output, router stats, experts [B, T, k]); the last two None for a dense layer."""
        if isinstance(self.mlp, MoeBlock):
            return self.mlp(x, valid, routes, replay)
        return self.mlp(x, rng), None, None

    def decode_step(self, x, positions, cache_k, cache_v, mask):
        """`with_cache` for one token a row, reading the caches only: (the residual stream, the token's key and
        value, its experts or None)."""
        h, k, v = self.attn.decode_step(self.input_norm(x), positions, cache_k, cache_v, mask)
        x = x + h
        h, _, experts = self._feed_forward(self.post_attn_norm(x))
        return constrain(x + h, ("batch", "length", "act_embed")), k, v, experts

    def with_cache(self, x, positions, cache_k, cache_v, mask):
        """(the residual stream, the caches, the experts each token went to [B, T, k] or None for a dense layer)."""
        h, cache_k, cache_v = self.attn.with_cache(self.input_norm(x), positions, cache_k, cache_v, mask)
        x = x + h
        h, _, experts = self._feed_forward(self.post_attn_norm(x))
        return constrain(x + h, ("batch", "length", "act_embed")), cache_k, cache_v, experts


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose parameters carry a leading [L] axis named `layers` (every layer alike: the config
    refuses scanned layers that differ)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        return DecoderLayer(cfg, nnx.Rngs(params=key), sparse=cfg.sparse_layers[0])

    stacked = create(jax.random.split(rngs.params(), cfg.num_layers))
    for _, var in nnx.iter_graph(stacked):
        if isinstance(var, nnx.Variable):
            var.set_metadata("logical_axes", ("layers", *tuple(var.get_metadata("logical_axes"))))
    return stacked


class Decoder(nnx.Module):
    """`model(tokens, positions=None, segment_ids=None, branch_ids=None) -> float32 logits [B, T, V]`.

    `segment_ids` (int [B, T]) separates packed documents; 0 marks padding.
    `positions` restart at 0 for each packed document (default: 0..T-1).
    `branch_ids` (int [B, T]) lets several continuations share one prefix in
    a segment: 0 = the shared prefix, k >= 1 = continuation k, which sees the
    prefix and itself only (`core.kernels.attention.make_mask`); its
    positions continue from the prefix's.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg.model_copy()
        self.embed = Embed(cfg, rngs)
        self.layers: Any  # one stacked DecoderLayer (scanned) or a list of them
        if cfg.scan_layers:
            self.layers = _stacked_layers(cfg, rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs, sparse) for sparse in cfg.sparse_layers])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype_of(cfg.param_dtype), rngs)
        d, v = cfg.hidden_size, cfg.vocab_size
        head = None if cfg.tie_word_embeddings else Dense("BTD,DV->BTV", (d, v), ("embed", "vocab"), cfg, rngs)
        self.lm_head = nnx.data(head)

    def __call__(self, tokens, positions=None, segment_ids=None, branch_ids=None) -> jax.Array:
        return self.logits(self.hidden_states(tokens, positions, segment_ids, branch_ids))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits [B, T, V] from final hidden states [B, T, D]."""
        weight, layout = self.output_weight()
        eq = "BTD,DV->BTV" if layout == "dv" else "BTD,VD->BTV"
        logits = jnp.einsum(eq, hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[jax.Array, jax.Array]:
        """Zeroed KV cache (k, v), each [L, B, S, K, H], slot index = token position."""
        c = self.cfg
        shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.resolved_head_dim)
        dtype = dtype or dtype_of(c.dtype)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def with_cache(self, tokens, positions, cache_k, cache_v):
        """Run `tokens` [B, T] at `positions` [B, T] against the KV cache (prefill or one decode step).

        Returns final-norm hidden states [B, T, D], the updated caches, and the experts each token was routed to
        in each sparse layer ([B, T, sparse layers, k] int32; None for a dense model: what routing replay reads).
        Keys at slots after a token's position are masked, so stale slots never leak in. One token a row (a decode
        step) reads the caches only and writes its keys into them once, after every layer (`_decode_step`).
        """
        slots = jnp.broadcast_to(jnp.arange(cache_k.shape[2], dtype=jnp.int32), (tokens.shape[0], cache_k.shape[2]))
        if tokens.shape[1] == 1:
            return self._decode_step(tokens, positions, cache_k, cache_v, slots)
        mask = make_mask(positions, slots, sliding_window=self.cfg.sliding_window)  # [B, T, S]
        step = lambda layer, h, k, v: layer.with_cache(h, positions, k, v, mask)
        x, cache_k, cache_v, routes = self._each_layer(self.embed(tokens), cache_k, cache_v, step)
        return self.final_norm(x), cache_k, cache_v, routes

    def _each_layer(self, x, cache_k, cache_v, step):
        """`step(layer, x, layer's cache_k, layer's cache_v) -> (x, k, v, experts)` through every layer (scanned or
        listed): (x, the layers' k and v stacked [L, ...], the experts [B, T, sparse layers, k] or None)."""
        if self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(h, layer):
                st, k, v = layer
                h, k, v, experts = step(nnx.merge(graphdef, st), h, k, v)
                return h, (k, v, experts)

            x, (ks, vs, experts) = jax.lax.scan(body, x, (state, cache_k, cache_v))
            return x, ks, vs, None if experts is None else jnp.moveaxis(experts, 0, 2)  # [L, B, T, k] -> [B, T, L, k]
        ks, vs, chosen = [], [], []
        for i, layer in enumerate(self.layers):
            x, k, v, experts = step(layer, x, cache_k[i], cache_v[i])
            ks.append(k)
            vs.append(v)
            if experts is not None:
                chosen.append(experts)
        return x, jnp.stack(ks), jnp.stack(vs), jnp.stack(chosen, axis=2) if chosen else None

    def _decode_step(self, tokens, positions, cache_k, cache_v, slots):
        """`with_cache` for tokens [B, 1]: each layer attends to the cache's keys before the token's position and to
        the token's own key (`core.kernels.attention.cached_step`), so no layer copies its cache; the new keys and
        values of every layer are scattered into the caches at the end, in place."""
        mask = slots[:, None, :] < positions[:, :, None]  # [B, 1, S]: strictly before (its own key comes apart)
        if self.cfg.sliding_window is not None:
            mask &= window_mask(positions, slots, self.cfg.sliding_window)
        step = lambda layer, h, k, v: layer.decode_step(h, positions, k, v, mask)
        x, new_k, new_v, routes = self._each_layer(self.embed(tokens), cache_k, cache_v, step)
        rows = jnp.arange(tokens.shape[0])
        cache_k = cache_k.at[:, rows, positions[:, 0]].set(new_k[:, :, 0])  # [L, B, K, H] at each row's position
        cache_v = cache_v.at[:, rows, positions[:, 0]].set(new_v[:, :, 0])
        return self.final_norm(x), cache_k, cache_v, routes

    def output_weight(self) -> tuple[jax.Array, str]:
        """The output projection and its layout: ([D, V], "dv") or the tied embedding ([V, D], "vd")."""
        if self.lm_head is None:
            return self.embed.embedding[...], "vd"
        assert self.lm_head.kernel is not None  # the head is never stored quantized
        return self.lm_head.kernel[...], "dv"

    def hidden_states(self, tokens, positions=None, segment_ids=None, branch_ids=None, compact: int = 0) -> jax.Array:
        """Final-norm hidden states [B, T, D] in the compute dtype (input of the output projection).

        With `compact` > 0 (`core.batch.PackedBatch.compact`: at least the real tokens of each data shard's
        rows) every layer but attention runs on the real tokens only (`core.models.compact`), and padding
        positions read zeros."""
        return self.layer_states(tokens, positions, segment_ids, branch_ids, compact)[0]

    def layer_states(
        self,
        tokens,
        positions=None,
        segment_ids=None,
        branch_ids=None,
        compact: int = 0,
        layers: Sequence[int] = (),
        rng: jax.Array | None = None,
        routes: jax.Array | None = None,
        replay: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(`hidden_states`, the residual stream after each decoder layer numbered in `layers`, [B, T, D] each, in
        the order given). Layer l counts from 1: the output of the l-th decoder layer, before the final norm
        (transformers' `output_hidden_states[l]` for l < num_layers; its last entry has the final norm applied).
        Scanned layers run as one scan per stretch between two requested layers, so no [L, B, T, D] stack of
        every layer's output is kept. `rng`: the key of LoRA's dropout (a training pass; None: none). `routes`
        [B, T, sparse layers, k] int32: the experts a sampler routed each token to (-1: none), used in place of the
        routers' own with `replay` (routing replay), else only compared with them (`RouterStats.differed`)."""
        for layer in layers:
            if not 1 <= layer <= self.cfg.num_layers:
                raise ValueError(f"layer {layer} is not a decoder layer of this model (1..{self.cfg.num_layers})")
        if self.cfg.lora is None or self.cfg.lora.dropout == 0:
            rng = None  # LoRA's dropout is the only randomness of a forward pass
        b, t = tokens.shape
        index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = index if positions is None else positions
        mask = make_mask(index, index, segment_ids, segment_ids, q_branch=branch_ids, kv_branch=branch_ids)
        if self.cfg.sliding_window is not None:
            # On positions, not row indices: a branch's tokens sit further from the prefix in the row than
            # in their sequence (without branches the two differ by a constant within a segment).
            mask &= window_mask(positions, positions, self.cfg.sliding_window)
        layout = None if segment_ids is None else Compaction.of(segment_ids, compact)
        # The real tokens, which a mixture of experts' router statistics count (None: every token).
        valid: jax.Array | None = None if segment_ids is None else segment_ids > 0
        if layout is not None:
            tokens, positions, valid = layout.to_compact(tokens), layout.to_compact(positions), layout.real()
            routes = None if routes is None else layout.to_compact(routes)
        x = constrain(self.embed(tokens), ("batch", "length", "act_embed"))
        replayed = None if routes is None else (routes, replay)
        x, stops, router = self._run_layers(x, positions, mask, layout, sorted(set(layers)), rng, valid, replayed)
        if router is not None:
            record_router(self, router)  # for the training loss's router terms (`core.router_loss`)
        x = self.final_norm(x)
        rows = (lambda h: h) if layout is None else layout.to_rows
        return rows(x), tuple(rows(stops[layer]) for layer in layers)

    def _run_layers(
        self, x, positions, mask, layout, stops: list[int], rng: jax.Array | None = None, valid=None, replayed=None
    ) -> tuple[jax.Array, dict[int, jax.Array], RouterStats | None]:
        """The residual stream after every layer, after each layer numbered in `stops` (sorted), and the routers'
        stats summed over the sparse layers (None without any). `replayed`: (routes [..., sparse layers, k],
        replay) or None."""
        routes, replay = (None, False) if replayed is None else replayed
        sparse_index = [sum(self.cfg.sparse_layers[:i]) for i in range(self.cfg.num_layers)]  # among sparse layers

        def apply(graphdef, state, x, key, layer_routes=None):
            return nnx.merge(graphdef, state)(x, positions, mask, layout, key, valid, layer_routes, replay)

        policy = self.cfg.remat_policy
        if policy != "none":
            apply = jax.checkpoint(apply, policy=REMAT_POLICIES[policy], static_argnums=(0,))
        per_layer = None if routes is None else jnp.moveaxis(routes, -2, 0)  # [sparse layers, ..., k]

        kept: dict[int, jax.Array] = {}
        router: list[RouterStats] = []
        n = self.cfg.num_layers
        keys = None if rng is None else jax.random.split(rng, n)  # one a layer
        if self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            start = 0
            for stop in [*stops, n]:
                if stop > start:
                    part = state if (start, stop) == (0, n) else jax.tree.map(lambda p, a=start, b=stop: p[a:b], state)
                    part_keys = None if keys is None else keys[start:stop]
                    # Scanned layers are all alike: sparse ones take their routes along the scan, dense ones none.
                    part_routes = None if per_layer is None else per_layer[start:stop]
                    step = lambda h, s: apply(graphdef, s[0], h, s[1], s[2])
                    x, stats = jax.lax.scan(step, x, (part, part_keys, part_routes), unroll=self.cfg.scan_unroll)
                    if stats is not None:  # [layers, ...] of the stretch's sparse layers
                        router.append(jax.tree.map(lambda a: a.sum(axis=0), stats))
                kept[stop] = x
                start = stop
        else:
            for i, layer in enumerate(self.layers, start=1):
                graphdef, state = nnx.split(layer)
                mine = (
                    None if per_layer is None or not self.cfg.sparse_layers[i - 1] else per_layer[sparse_index[i - 1]]
                )
                x, stats = apply(graphdef, state, x, None if keys is None else keys[i - 1], mine)
                if stats is not None:
                    router.append(stats)
                kept[i] = x
        return x, kept, sum(router[1:], router[0]) if router else None
