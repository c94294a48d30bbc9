"""Mixture-of-experts layers: top-k routing, the dropless grouped expert matmuls, expert parallelism, routing replay.

    weights, experts = route_topk(router_logits, k=2, normalize=True)       # [T, k] gate weights, expert ids
    y = tiled_experts(x, weights, experts, w_gate, w_up, w_down)             # [T, D], every routed token computed
    y = grouped_experts(x, weights, experts, w_gate, w_up, w_down)           # the same through jax.lax.ragged_dot
    y = dense_experts(x, weights, experts, w_gate, w_up, w_down)             # the reference: every expert, masked

Both grouped forms are dropless (no capacity: no token is dropped, whatever the routing): the T * k (token,
expert) assignments are sorted by expert, the SwiGLU experts run over each expert's contiguous rows, and the
results go back to their tokens, summed with the gate weights. `grouped_experts` is `ragged_dot`, the grouped GEMM
of GPU and TPU backends; on this CPU XLA lowers it to masked work on every expert, so `tiled_experts` (megablox's
blocks of rows) is the CPU form (`experts_kernel`, `model.moe.kernel`; figures in docs/kernels.md). The dense
reference runs every expert on every token ([E, T, F] intermediates) and is what the tests compare with.

`MoeBlock` is the model layer (`model.moe`, the qwen2_moe, qwen3_moe and mixtral families): the router and the stacked
experts; split over the mesh's expert axis it exchanges tokens over that axis (`expert_parallel`); given a
sampler's routes it replays them (`replayed_routes`). It returns its `RouterStats` beside its output, which the
training losses read (`core.router_loss`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.config import ModelConfig
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


def _swiglu(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
    return jax.nn.silu(h_gate) * h_up


def _by_expert(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The T * k (token, expert) assignments grouped by expert: (their experts, flat [T * k]: assignment a = token
    * k + slot; the order that sorts them by expert, tokens in order within a group; rows per expert [E], ids >= E
    counted in none)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return flat, order, jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def _to_tokens(sorted_out: jax.Array, order: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Each assignment's output, in expert order ([T * k, D]), back at its token: summed over the k slots with the
    gate weights ([T, k]), in `dtype`."""
    t, k = weights.shape
    unsorted = jnp.zeros_like(sorted_out).at[order].set(sorted_out).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", unsorted, weights.astype(unsorted.dtype)).astype(dtype)


def _ranks(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each (token, expert) assignment's place among its expert's, in token order: (the sort by expert from
    `_by_expert`, the sorted assignments' experts, their ranks within their expert's group, both [T * k], and the
    rows per expert [E])."""
    flat, order, sizes = _by_expert(experts, n_experts)
    ranked = flat[order]
    group_start = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - group_start[jnp.minimum(ranked, n_experts - 1)]
    return order, ranked, rank, sizes


def grouped_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """The routed SwiGLU experts on `x` [T, D], dropless: `weights`, `experts` [T, k] from `route_topk`;
    `w_gate`, `w_up` [E, D, F], `w_down` [E, F, D]. Returns [T, D] in `x`'s dtype. An expert id >= E (another
    device's expert, `expert_parallel`) is not computed: its rows sort last, outside every group, and read 0."""
    k = experts.shape[1]
    n_experts = w_gate.shape[0]
    flat, order, sizes = _by_expert(experts, n_experts)
    rows = x[order // k]  # [T * k, D]: each assignment's token
    # Rows past the groups (ids >= E) are masked, not trusted to read 0: ragged_dot promises nothing for them.
    here = (flat[order] < n_experts)[:, None]
    h = _swiglu(jax.lax.ragged_dot(rows, w_gate, sizes), jax.lax.ragged_dot(rows, w_up, sizes))
    out = jnp.where(here, jax.lax.ragged_dot(jnp.where(here, h, 0), w_down, sizes), 0)  # [T * k, D], sorted
    return _to_tokens(out, order, weights, x.dtype)


def tiled_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    block: int | None = None,
) -> jax.Array:
    """`grouped_experts` with the grouped matmul as blocks of `block` rows, each of one expert (megablox's layout):
    each expert's assignments start a new block, so its last block is padded, and every block runs its three
    matmuls with its own expert's weights (batched). Work is the routed rows plus that padding; memory is
    the padded rows (at most T * k + E * block) and each block's copy of its expert's weights, never a per-expert
    copy of every row. The form for CPU, where XLA lowers `ragged_dot` to masked work on every expert
    (docs/kernels.md). Ids >= E are not computed (as there): they get no row."""
    t, k = experts.shape
    n_experts = w_gate.shape[0]
    m = t * k
    if block is None:  # about two blocks an expert when balanced, within 8..256 rows (measured best near 256)
        block = int(min(256, max(8, 2 ** math.ceil(math.log2(max(1, m // (2 * n_experts)))))))
    order, ranked, rank, sizes = _ranks(experts, n_experts)
    blocks_of = (sizes + block - 1) // block
    block_end = jnp.cumsum(blocks_of)  # the first block after each expert's
    n_blocks = -(-m // block) + n_experts
    first_row = (block_end - blocks_of) * block  # each expert's first padded row
    e = jnp.minimum(ranked, n_experts - 1)
    slot = jnp.where(ranked < n_experts, first_row[e] + rank, n_blocks * block)
    # Each block's expert; the slack blocks past the last expert's (all-zero rows) borrow its weights.
    owner = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(n_blocks), side="right"), n_experts - 1)
    # Each block's expert weights gathered ([blocks, D, F]: the blocks of one expert share them) and every block
    # multiplied in one batched matmul; the backward pass sums the blocks' weight gradients back into their
    # experts. Measured on CPU (4096 rows, 16 experts, D 512, F 448, forward and backward): 0.26 s against 0.58 s
    # for a loop over the blocks indexing the weights, whose backward pass rewrites the [E, D, F] gradient each block.
    return _through_blocks(x, weights, order, slot, block, w_gate[owner], w_up[owner], w_down[owner])


def _through_blocks(
    x: jax.Array,
    weights: jax.Array,
    order: jax.Array,
    slot: jax.Array,
    block: int,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """The experts on blocks of rows: each assignment's token (sorted by `order`) written at its row `slot` of
    [blocks, block] rows (a slot past the end: not computed), every block through its own SwiGLU expert (`w_gate`,
    `w_up` [blocks, D, F], `w_down` [blocks, F, D]: one batched matmul each), and the outputs back at their tokens
    with the gate `weights` [T, k]. The tiled form's blocks and the capacity form's buffers are both this."""
    k = weights.shape[1]
    n_blocks, d, _ = w_gate.shape
    rows = jnp.zeros((n_blocks * block, d), x.dtype).at[slot].set(x[order // k], mode="drop")
    xb = rows.reshape(n_blocks, block, d)
    h = _swiglu(jnp.einsum("nbd,ndf->nbf", xb, w_gate), jnp.einsum("nbd,ndf->nbf", xb, w_up))
    out = jnp.einsum("nbf,nfd->nbd", h, w_down)
    per_assignment = jnp.take(out.reshape(-1, d), slot, axis=0, mode="fill", fill_value=0)  # sorted order
    return _to_tokens(per_assignment, order, weights, x.dtype)


def expert_capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """The assignments each expert takes with capacity factor `factor`: ceil(factor * tokens * k / experts)
    (GShard's; factor 1 is an even share)."""
    return max(1, math.ceil(factor * tokens * k / n_experts))


def within_capacity(experts: jax.Array, n_experts: int, capacity: int) -> jax.Array:
    """[T, k] bool: whether each assignment is among the first `capacity` of its expert's, in token order (an id
    >= E, a token not routed, never is); the others are dropped (capacity factor, `model.moe.capacity_factor`)."""
    order, ranked, rank, _ = _ranks(experts, n_experts)
    keep = (ranked < n_experts) & (rank < capacity)
    return jnp.zeros(keep.shape, bool).at[order].set(keep).reshape(experts.shape)


def capacity_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    capacity: int,
) -> jax.Array:
    """The capacity-based form (GShard, Switch; MaxText's dense path): every expert gets a fixed buffer of
    `capacity` rows ([E, C, D], one batched matmul per projection, static shapes), filled with its first
    `capacity` assignments in token order; the rest are dropped (read 0). Work and memory are E * C rows however
    the tokens route. Equal to `tiled_experts` on the assignments `within_capacity` keeps."""
    n_experts = w_gate.shape[0]
    order, ranked, rank, _ = _ranks(experts, n_experts)
    slot = jnp.where((ranked < n_experts) & (rank < capacity), ranked * capacity + rank, n_experts * capacity)
    return _through_blocks(x, weights, order, slot, capacity, w_gate, w_up, w_down)


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


def experts_kernel(kind: Literal["auto", "ragged_dot", "tiled", "capacity"], capacity: int = 0):
    """The grouped-matmul function `model.moe.kernel` names (`auto`: tiled on CPU, ragged_dot elsewhere;
    `capacity`: `capacity_experts` with `capacity` rows an expert)."""
    if kind == "capacity":
        return functools.partial(capacity_experts, capacity=capacity)
    if kind == "auto":
        kind = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    return tiled_experts if kind == "tiled" else grouped_experts


def _expert_axis() -> int:
    """The size of the `expert` axis of the mesh set with `jax.set_mesh` (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(EXPERT_AXIS, 1)


def dense_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """The reference for `grouped_experts`: every expert on every token, each output weighted by its gate weight
    (0 for the experts a token was not routed to)."""
    n_experts = w_gate.shape[0]
    gate = (jax.nn.one_hot(experts, n_experts, dtype=weights.dtype) * weights[..., None]).sum(axis=1)  # [T, E]
    h = _swiglu(jnp.einsum("td,edf->etf", x, w_gate), jnp.einsum("td,edf->etf", x, w_up))
    out = jnp.einsum("etf,efd->etd", h, w_down)
    return jnp.einsum("etd,te->td", out, gate.astype(out.dtype)).astype(x.dtype)


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
        h = _swiglu(x @ w(self.shared_gate), x @ w(self.shared_up)) @ w(self.shared_down)
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
