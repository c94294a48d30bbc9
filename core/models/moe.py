"""Mixture-of-experts layers: top-k routing, expert parallelism, routing replay, the router's statistics.

    weights, experts = route_topk(router_logits, k=2, normalize=True)       # [T, k] gate weights, expert ids
    y, stats, experts = MoeBlock(cfg, rngs)(x)                               # the layer: router + stacked experts

`MoeBlock` is the model layer (`model.moe`, the qwen2_moe, qwen3_moe and mixtral families): the router and the stacked
experts, run by one of the grouped-matmul forms of `core.kernels.experts` (dropless by default; tiled on CPU); split
over the mesh's expert axis it exchanges tokens over that axis (`expert_parallel`); given a sampler's routes it
replays them (`replayed_routes`). It returns its `RouterStats` beside its output, which the training losses read
(`core.router_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.config import ModelConfig
from core.kernels.experts import (
    expert_capacity,
    experts_kernel,
    grouped_experts,
    swiglu,
    within_capacity,
)
from core.mesh import EXPERT_AXIS, constrain, spec_axes
from core.models.layers import dtype_of, param


def route_topk(router_logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """[T, E] router logits -> ([T, k] float32 gate weights, [T, k] int32 expert ids): the softmax over all experts,
    its k largest, renormalised to sum to 1 when `normalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral always)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


EXPERT_AXES = ("experts", "embed", "mlp")  # w_gate / w_up's logical axes; w_down's are ("experts", "mlp", "embed")


def expert_parallel(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    kernel=grouped_experts,
) -> jax.Array | None:
    """`grouped_experts` with the experts split over the mesh's `expert` axis, as one `jax.shard_map` manual over
    the whole mesh (so every device sorts only its own tokens); None when the rows do not split over the axis.

    Tokens are exchanged by all-gather and reduce-scatter over the expert axis (Megatron's "allgather" token
    dispatcher): each device gathers the tokens of its group of that axis, computes those routed to its own
    E / n experts, dropless, and the partial outputs are summed back onto the devices that own the tokens. The
    experts' embed dimension is gathered over the axes that shard it (ZeRO-3), their width stays split over its
    axes (tensor parallelism: the partial outputs are summed over them). `x` [B, L, D] and the routes [B, L, k]
    are split like the batch. `kernel`: the grouped matmul each device runs (`experts_kernel`). Equal to it on one
    device, up to the order of the sums."""
    from jax.sharding import PartitionSpec as P

    from core.mesh import logical_to_spec

    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(mesh.shape)
    rows = logical_to_spec(("batch", "length", None), x.shape, shape)
    if EXPERT_AXIS not in spec_axes(rows[0]):
        return None
    route_spec = P(rows[0], rows[1], None)
    up_spec = logical_to_spec(EXPERT_AXES, w_gate.shape, shape)
    down_spec = logical_to_spec(("experts", "mlp", "embed"), w_down.shape, shape)
    embed_axes, width_axes = spec_axes(up_spec[1]), spec_axes(up_spec[2])

    def gather(w, axis: int, over: tuple[str, ...]):
        for name in reversed(over):  # the minor-most axis first, so the pieces come back in order
            w = jax.lax.all_gather(w, name, axis=axis, tiled=True)
        return w

    def local(x, weights, experts, w_gate, w_up, w_down):
        b, l, d = x.shape
        flat = x.reshape(b * l, d)
        # Gathered in float32: a gather's backward pass is a reduce-scatter (see below).
        xs = jax.lax.all_gather(flat.astype(jnp.float32), EXPERT_AXIS, tiled=True).astype(x.dtype)  # group's tokens
        ws = jax.lax.all_gather(weights.reshape(b * l, -1).astype(jnp.float32), EXPERT_AXIS, tiled=True)
        es = jax.lax.all_gather(experts.reshape(b * l, -1), EXPERT_AXIS, tiled=True)
        per_device = w_gate.shape[0]
        mine = es - jax.lax.axis_index(EXPERT_AXIS) * per_device  # ids of this device's experts: 0..per_device-1
        here = (mine >= 0) & (mine < per_device)
        wg, wu, wd = gather(w_gate, 1, embed_axes), gather(w_up, 1, embed_axes), gather(w_down, 2, embed_axes)
        y = kernel(xs, jnp.where(here, ws, 0).astype(x.dtype), jnp.where(here, mine, per_device), wg, wu, wd)
        # Summed in float32: the experts' partial outputs keep their precision in bfloat16 training (and XLA:CPU
        # 0.10.2 aborts compiling a bfloat16 reduce-scatter here, in its AllReducePromotion pass).
        y = jax.lax.psum_scatter(y.astype(jnp.float32), EXPERT_AXIS, scatter_dimension=0, tiled=True)
        if width_axes:
            y = jax.lax.psum(y, width_axes)
        return y.astype(x.dtype).reshape(b, l, d)

    return jax.shard_map(
        local,
        in_specs=(rows, route_spec, route_spec, up_spec, up_spec, down_spec),
        out_specs=rows,
    )(x, weights, experts, w_gate, w_up, w_down)


def _expert_axis() -> int:
    """The size of the `expert` axis of the mesh set with `jax.set_mesh` (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(EXPERT_AXIS, 1)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RouterStats:
    """What one forward pass's routers did over its real tokens, summed over its sparse layers: the sums
    transformers' load-balancing loss and the router z-loss are made of, and the tokens each expert got."""

    counts: Any  # [E] float32: top-k assignments per expert (sum: k x tokens x layers)
    probs: Any  # [E] float32: the router's softmax probabilities per expert, summed over tokens
    tokens: Any  # float32 scalar: real tokens x sparse layers
    z: Any  # float32 scalar: sum of logsumexp(router logits)^2
    # Tokens x layers that came with a sampler's routes (`MoeBlock`'s `routes`), and those whose own top-k set
    # differed from them: the routing mismatch between sampler and trainer, measured with replay or without.
    routed: Any = 0.0
    differed: Any = 0.0
    # Top-k assignments of real tokens past their expert's capacity (`model.moe.capacity_factor`): not computed.
    dropped: Any = 0.0

    def __add__(self, other: RouterStats) -> RouterStats:
        return jax.tree.map(jnp.add, self, other)

    def load_balance_loss(self) -> jax.Array:
        """num_experts * sum_e (share of assignments to e) * (mean probability of e), the shares and means pooled
        over the layers and tokens (transformers' `load_balancing_loss_func` for Qwen3-MoE and Mixtral)."""
        rows = jnp.maximum(self.tokens, 1.0)
        return self.counts.shape[-1] * jnp.sum((self.counts / rows) * (self.probs / rows))

    def z_loss(self) -> jax.Array:
        """The mean over tokens and layers of logsumexp(router logits)^2 (ST-MoE's router z-loss)."""
        return self.z / jnp.maximum(self.tokens, 1.0)


def router_stats(
    router_logits: jax.Array,
    experts: jax.Array,
    valid: jax.Array | None,
    routed: jax.Array | None = None,
    differed: jax.Array | None = None,
    dropped: jax.Array | None = None,
) -> RouterStats:
    """`RouterStats` of one layer: [T, E] logits, [T, k] chosen experts, [T] bool real tokens (None: all); [T] bool
    tokens that came with a sampler's routes and those whose own top-k set differed from them (None: none); [T]
    assignments a token lost to the capacity (None: none)."""
    t, n_experts = router_logits.shape
    logits = router_logits.astype(jnp.float32)
    v = jnp.ones((t,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    counts = jnp.zeros((n_experts,), jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(v, experts.shape[1]))
    probs = (jax.nn.softmax(logits, axis=-1) * v[:, None]).sum(axis=0)
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * v)
    count = lambda m: jnp.zeros((), jnp.float32) if m is None else jnp.sum(m.astype(jnp.float32) * v)
    return RouterStats(counts, probs, v.sum(), z, count(routed), count(differed), count(dropped))


def check_routes(routes: np.ndarray, cfg: ModelConfig, where: str = "the batch's routes") -> None:
    """Refuse routes a model cannot replay, naming what is wrong: their shape must end in (sparse layers, k), and
    each token's k experts must be all -1 (not routed) or distinct experts of this model."""
    moe = cfg.moe
    if moe is None:
        raise ValueError(f"{where}: the model has no experts to route to (model.moe is unset)")
    want = (sum(cfg.sparse_layers), moe.experts_per_token)
    if routes.ndim < 3 or tuple(routes.shape[-2:]) != want:
        raise ValueError(f"{where}: shape {routes.shape} does not end in (sparse layers, k) = {want}")
    flat = routes.reshape(-1, want[1])
    none = (flat == -1).all(axis=1)
    inside = ((flat >= 0) & (flat < moe.num_experts)).all(axis=1)
    ordered = np.sort(flat, axis=1)
    distinct = (ordered[:, 1:] != ordered[:, :-1]).all(axis=1)
    bad = np.flatnonzero(~(none | (inside & distinct)))
    if len(bad):
        raise ValueError(
            f"{where}: {len(bad)} token(s) routed to experts outside 0..{moe.num_experts - 1}, repeated, or partly "
            f"unrouted, e.g. {flat[bad[0]].tolist()}"
        )


def replayed_routes(
    router_logits: jax.Array, own: jax.Array, routes: jax.Array, normalize: bool, replay: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Routing replay (R3): the experts a sampler routed each token to, in place of the router's own top-k.

    `router_logits` [T, E], `own` [T, k] the router's own top-k, `routes` [T, k] the sampler's (-1: a token it
    did not route, which keeps its own). With `replay`, a routed token uses the sampler's experts, weighted by
    this router's softmax probabilities at them (renormalised when `normalize`), so the router still learns;
    without it, the routes are only compared. Returns ([T, k] weights, [T, k] experts, [T] tokens with routes,
    [T] tokens whose own top-k set differs from the routes)."""
    routed = jnp.all(routes >= 0, axis=-1)
    differed = routed & jnp.any(jnp.sort(own, axis=-1) != jnp.sort(routes, axis=-1), axis=-1)
    experts = jnp.where(routed[:, None], routes, own) if replay else own
    weights = jnp.take_along_axis(jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1), experts, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), routed, differed


class MoeBlock(nnx.Module):
    """The sparse feed-forward layer: a router ([D, E], no bias) and E SwiGLU experts stacked on a leading axis
    (`w_gate`, `w_up` [E, D, F], `w_down` [E, F, D]), dropless (`experts_kernel`: tiled on CPU) unless a
    capacity factor is set; Qwen2-MoE adds a gated shared expert (`shared_expert`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        assert cfg.moe is not None
        moe = cfg.moe
        d, f, e = cfg.hidden_size, moe.intermediate_size, moe.num_experts
        pd = dtype_of(cfg.param_dtype)
        self.router = param(rngs, (d, e), ("embed", "experts"), pd, fan_in=d)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), pd, fan_in=d)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), pd, fan_in=d)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), pd, fan_in=f)
        fs = moe.shared_intermediate_size
        if fs:  # Qwen2-MoE's shared expert, and the gate that scales it per token
            self.shared_gate = param(rngs, (d, fs), ("embed", "mlp"), pd, fan_in=d)
            self.shared_up = param(rngs, (d, fs), ("embed", "mlp"), pd, fan_in=d)
            self.shared_down = param(rngs, (fs, d), ("mlp", "embed"), pd, fan_in=fs)
            self.shared_router = param(rngs, (d, 1), ("embed", None), pd, fan_in=d)
        self.shared = bool(fs)
        self.k = moe.experts_per_token
        self.normalize = moe.normalize_topk
        self.kernel = moe.kernel
        self.capacity_factor = moe.capacity_factor
        self.dtype = dtype_of(cfg.dtype)

    def route(self, x_flat: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[T, D] tokens -> ([T, E] float32 router logits, [T, k] gate weights, [T, k] expert ids)."""
        logits = jnp.einsum(
            "td,de->te", x_flat, self.router[...].astype(x_flat.dtype), preferred_element_type=jnp.float32
        )
        weights, experts = route_topk(logits, self.k, self.normalize)
        return logits, weights, experts

    def shared_expert(self, x: jax.Array) -> jax.Array:
        """Qwen2-MoE's shared expert on [..., D] tokens: a SwiGLU MLP every token goes through, times
        sigmoid(x @ its gate)."""
        w = lambda p: p[...].astype(self.dtype)
        h = swiglu(x @ w(self.shared_gate), x @ w(self.shared_up)) @ w(self.shared_down)
        return jax.nn.sigmoid(x @ w(self.shared_router)) * h

    def __call__(
        self, x: jax.Array, valid: jax.Array | None = None, routes: jax.Array | None = None, replay: bool = False
    ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """[B, T, D] -> ([B, T, D], this layer's `RouterStats` over the tokens `valid` [B, T] marks real, the
        experts each token went to [B, T, k]). `routes` [B, T, k]: a sampler's experts for each token (-1: none),
        used in place of the router's own with `replay` (`replayed_routes`), else only compared with them."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, experts = self.route(flat)
        routed = differed = None
        if routes is not None:
            weights, experts, routed, differed = replayed_routes(
                logits, experts, routes.reshape(-1, self.k), self.normalize, replay
            )
        # What the kernel runs: the routed assignments, less those past their expert's capacity (an id past the
        # experts is not computed, by any kernel); the stats and the returned experts stay the router's choice.
        run_weights, run_experts, dropped, capacity = weights, experts, None, 0
        if self.capacity_factor > 0:  # each expert takes its first `capacity` real tokens' assignments
            n_experts = self.w_gate.shape[0]
            capacity = expert_capacity(flat.shape[0], self.k, n_experts, self.capacity_factor)
            real = jnp.ones(flat.shape[:1], bool) if valid is None else valid.reshape(-1)
            kept = within_capacity(jnp.where(real[:, None], experts, n_experts), n_experts, capacity)
            dropped = (real[:, None] & ~kept).sum(axis=-1)
            run_weights, run_experts = jnp.where(kept, weights, 0), jnp.where(kept, experts, n_experts)
        kernel = experts_kernel(self.kernel, capacity)
        w = lambda p: p[...].astype(self.dtype)
        params = (w(self.w_gate), w(self.w_up), w(self.w_down))
        y = None
        if _expert_axis() > 1:  # expert parallelism: the mesh splits the experts (None: the rows do not split)
            gates, chosen = run_weights.reshape(*lead, -1).astype(self.dtype), run_experts.reshape(*lead, -1)
            y = expert_parallel(x, gates, chosen, *params, kernel=kernel)
        if y is None:
            y = kernel(flat, run_weights.astype(self.dtype), run_experts, *params).reshape(*lead, -1)
        if self.shared:
            y = y + self.shared_expert(x)
        stats = router_stats(logits, experts, None if valid is None else valid.reshape(-1), routed, differed, dropped)
        return constrain(y, ("batch", "length", "act_embed")), stats, experts.reshape(*lead, self.k)
