"""The grouped expert matmuls of a mixture-of-experts layer (`core.models.moe.MoeBlock`): the routed SwiGLU experts on
a layer's tokens, dropless or with a capacity, in the forms each backend runs best.

    y = tiled_experts(x, weights, experts, w_gate, w_up, w_down)             # [T, D], every routed token computed
    y = grouped_experts(x, weights, experts, w_gate, w_up, w_down)           # the same through jax.lax.ragged_dot
    y = dense_experts(x, weights, experts, w_gate, w_up, w_down)             # the reference: every expert, masked

The dropless forms compute every routed assignment, whatever the routing: the T * k (token, expert) assignments
are sorted by expert, the SwiGLU experts run over each expert's contiguous rows, and the results go back to their
tokens, summed with the gate weights. `grouped_experts` is `ragged_dot`, the grouped GEMM of GPU and TPU backends;
on this CPU XLA lowers it to masked work on every expert, so `tiled_experts` (megablox's blocks of rows) is the
CPU form (`experts_kernel`, `model.moe.kernel`; figures in docs/kernels.md). `capacity_experts` drops what exceeds a
fixed buffer an expert (GShard). The dense reference runs every expert on every token ([E, T, F] intermediates) and
is what the tests compare with.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp


def swiglu(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
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
    h = swiglu(jax.lax.ragged_dot(rows, w_gate, sizes), jax.lax.ragged_dot(rows, w_up, sizes))
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
    h = swiglu(jnp.einsum("nbd,ndf->nbf", xb, w_gate), jnp.einsum("nbd,ndf->nbf", xb, w_up))
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


# A rounds buffer's rows per expert: an even share and a quarter (balanced routing fits one round).
ROUND_FACTOR = 1.25


def rounds_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    capacity: int | None = None,
) -> jax.Array:
    """Dropless through capacity buffers: the capacity form's fixed `[E, C, D]` buffers (one batched matmul per
    projection with every expert's weights where they lie, no copy of them), run in as many rounds as the step's
    largest load needs: round r takes each expert's assignments of rank r * C .. (r + 1) * C - 1, in token order.
    Balanced routing needs one round; an expert `n` times over the buffer needs `n` rounds, and the other experts'
    buffers run empty in them. So no assignment is dropped, whatever the routing: `tiled_experts`' result without
    copying an expert's weights for each block of rows. The price is that every round runs every expert's buffer:
    its work is E x C x rounds rows where the tiled form's is the routed rows and each block's padding. Measured
    on CPU (docs/kernels.md): faster than the tiled form on balanced routing (one round), slower on a layer whose
    busiest expert takes more than its buffer (two rounds), as a freshly initialised model's layers often route.

    The rounds are a scan over the most any routing could need (ceil(T / C): a token's k experts are distinct) whose
    rounds past the step's need skip their work (`lax.cond`), rematerialised in the backward pass (each round keeps
    nothing but its contribution to the output). `capacity` (default: an even share and a quarter, to a multiple
    of 8): the rows of an expert's buffer. Ids >= E are not computed (as in every form)."""
    t, k = experts.shape
    n_experts = w_gate.shape[0]
    if capacity is None:
        capacity = -(-expert_capacity(t, k, n_experts, ROUND_FACTOR) // 8) * 8
    order, ranked, rank, sizes = _ranks(experts, n_experts)
    valid = ranked < n_experts
    needed = -(-jnp.max(sizes) // capacity)  # rounds this routing needs
    most = max(1, -(-t // capacity))  # rounds any routing could need

    def one_round(r):
        here = valid & (rank // capacity == r)
        slot = jnp.where(here, ranked * capacity + rank % capacity, n_experts * capacity)
        return _through_blocks(x, weights, order, slot, capacity, w_gate, w_up, w_down)

    if most == 1:
        return one_round(0)

    @jax.checkpoint
    def more(y, r):
        skip = lambda: jnp.zeros_like(y)
        return y + jax.lax.cond(r < needed, lambda: one_round(r), skip), None

    # One round is the common case: the scan over the others runs only when the routing needs them.
    rounds = lambda: jax.lax.scan(more, one_round(0), jnp.arange(1, most))[0]
    return jax.lax.cond(needed > 1, rounds, lambda: one_round(0))


def experts_kernel(kind: Literal["auto", "ragged_dot", "tiled", "rounds", "capacity"], capacity: int = 0):
    """The grouped-matmul function `model.moe.kernel` names (`auto`: tiled on CPU, ragged_dot elsewhere;
    `capacity`: `capacity_experts` with `capacity` rows an expert)."""
    if kind == "capacity":
        return functools.partial(capacity_experts, capacity=capacity)
    if kind == "auto":
        kind = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    return {"tiled": tiled_experts, "rounds": rounds_experts, "ragged_dot": grouped_experts}[kind]


def dense_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """The reference for `grouped_experts`: every expert on every token, each output weighted by its gate weight
    (0 for the experts a token was not routed to)."""
    n_experts = w_gate.shape[0]
    gate = (jax.nn.one_hot(experts, n_experts, dtype=weights.dtype) * weights[..., None]).sum(axis=1)  # [T, E]
    h = swiglu(jnp.einsum("td,edf->etf", x, w_gate), jnp.einsum("td,edf->etf", x, w_up))
    out = jnp.einsum("etf,efd->etd", h, w_down)
    return jnp.einsum("etd,te->td", out, gate.astype(out.dtype)).astype(x.dtype)
