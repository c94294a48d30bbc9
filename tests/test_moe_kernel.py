"""The dropless grouped MoE experts (`core.models.moe`: `ragged_dot`, and the tiled form CPU runs) against the dense
reference (every expert on every token, masked): outputs and gradients, float32, to a few steps of float32 per
tensor; the tiled form's memory against the reference's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.kernels.experts import (
    capacity_experts,
    dense_experts,
    expert_capacity,
    grouped_experts,
    rounds_experts,
    tiled_experts,
    within_capacity,
)
from core.models.moe import route_topk

EPS = float(np.finfo(np.float32).eps)


def steps_apart(got, want) -> float:
    """The largest difference in units of float32's step at the tensor's own scale (its largest magnitude)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / (EPS * np.abs(want).max()))


def problem(t=96, d=32, f=48, e=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float32)
    router = jax.random.normal(keys[1], (d, e), jnp.float32)
    w_gate = jax.random.normal(keys[2], (e, d, f), jnp.float32) / d**0.5
    w_up = jax.random.normal(keys[3], (e, d, f), jnp.float32) / d**0.5
    w_down = jax.random.normal(keys[4], (e, f, d), jnp.float32) / f**0.5
    return x, router, w_gate, w_up, w_down


def loss(experts_fn, k, normalize, x, router, w_gate, w_up, w_down):
    weights, chosen = route_topk(x @ router, k, normalize)
    y = experts_fn(x, weights, chosen, w_gate, w_up, w_down)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))  # every output weighs


# ragged_dot; tiled with blocks of 8 rows (several blocks an expert, the last ones padded) and of 128 (one each)
KERNELS = {
    "ragged_dot": grouped_experts,
    "tiled, 8-row blocks": lambda *a: tiled_experts(*a, block=8),
    "tiled, 128-row blocks": lambda *a: tiled_experts(*a, block=128),
    # rounds of 8-row buffers (an even share is 12-36 rows here: several rounds, their last ones partly empty)
    "rounds, 8-row buffers": lambda *a: rounds_experts(*a, capacity=8),
}


# Every routing on the tiled form with 8-row blocks; the slower forms on a top-1 and a top-3 routing.
CASES = [("tiled, 8-row blocks", k, n) for k, n in [(1, False), (2, True), (2, False), (3, True)]]
CASES += [(kernel, k, n) for kernel in ("tiled, 128-row blocks", "ragged_dot") for k, n in [(1, False), (3, True)]]
CASES += [("rounds, 8-row buffers", k, n) for k, n in [(1, False), (2, True), (3, True)]]


@pytest.mark.parametrize("kernel,k,normalize", CASES)
def test_grouped_experts_equal_the_dense_reference_with_their_gradients(k, normalize, kernel):
    grouped_experts = KERNELS[kernel]
    args = problem()
    weights, chosen = route_topk(args[0] @ args[1], k, normalize)
    assert len(np.unique(np.asarray(chosen))) == 8  # every expert has tokens: every group is exercised
    sums = np.asarray(weights).sum(-1)
    if normalize:
        assert np.allclose(sums, 1.0)
    else:  # the k largest of a softmax over 8 experts, as they are
        assert (sums <= 1.0 + 1e-6).all() and (sums < 0.9).any()
    got = grouped_experts(args[0], weights, chosen, *args[2:])
    want = dense_experts(args[0], weights, chosen, *args[2:])
    assert steps_apart(got, want) < 16, steps_apart(got, want)
    grads = jax.grad(lambda *a: loss(grouped_experts, k, normalize, *a), argnums=range(5))(*args)
    wants = jax.grad(lambda *a: loss(dense_experts, k, normalize, *a), argnums=range(5))(*args)
    for name, g, w in zip(("x", "router", "w_gate", "w_up", "w_down"), grads, wants, strict=True):
        assert np.abs(np.asarray(w)).max() > 0, name  # the gradient reaches every input
        assert steps_apart(g, w) < 64, (name, steps_apart(g, w))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_an_expert_no_token_chose_gets_no_rows_and_no_gradient(kernel):
    grouped_experts = KERNELS[kernel]
    x, _, w_gate, w_up, w_down = problem(t=16)
    chosen = jnp.zeros((16, 1), jnp.int32).at[8:].set(3)  # experts 0 and 3 only
    weights = jnp.ones((16, 1), jnp.float32)
    got = grouped_experts(x, weights, chosen, w_gate, w_up, w_down)
    assert steps_apart(got, dense_experts(x, weights, chosen, w_gate, w_up, w_down)) < 16
    g = jax.grad(lambda w: grouped_experts(x, weights, chosen, w, w_up, w_down).sum())(w_gate)
    used = np.abs(np.asarray(g)).reshape(8, -1).max(axis=1) > 0
    assert used.tolist() == [e in (0, 3) for e in range(8)]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_ids_past_the_experts_are_not_computed(kernel):
    """Expert parallelism passes another device's experts as ids >= E: they add nothing (as a 0 gate weight)."""
    x, router, w_gate, w_up, w_down = problem(t=32)
    weights, chosen = route_topk(x @ router, 2, True)
    foreign = chosen.at[::3, 1].set(8)  # every third token's second expert lives elsewhere
    got = KERNELS[kernel](x, weights, foreign, w_gate, w_up, w_down)
    want = dense_experts(x, weights.at[::3, 1].set(0.0), chosen, w_gate, w_up, w_down)
    assert steps_apart(got, want) < 16


def test_the_tiled_form_needs_a_fraction_of_the_dense_references_memory():
    """XLA's temporary memory for the forward and backward pass (1024 tokens, 16 experts, top-2): the tiled form
    holds the routed rows in blocks, the reference an [E, T, F] intermediate for every expert."""
    x, router, w_gate, w_up, w_down = problem(t=1024, d=64, f=256, e=16)
    weights, chosen = route_topk(x @ router, 2, True)

    def temp(fn) -> int:
        grad = jax.grad(lambda x, w: fn(x, weights, chosen, w, w_up, w_down).sum(), argnums=(0, 1))
        return jax.jit(grad).lower(x, w_gate).compile().memory_analysis().temp_size_in_bytes

    tiled, dense = temp(tiled_experts), temp(dense_experts)
    print(f"temporary memory, forward and backward: tiled {tiled / 1e6:.1f} MB, dense reference {dense / 1e6:.1f} MB")
    assert tiled < 0.5 * dense


def test_the_rounds_form_is_dropless_however_skewed_the_routing():
    """A routing that sends every token to one expert (its load 64: 3 rounds of the default 24-row buffers, an even
    share and a quarter, where a balanced one needs 1) and one that fits one round: both equal the dense reference,
    outputs and gradients."""
    x, router, w_gate, w_up, w_down = problem(t=64, e=8)

    def grads(fn, weights, chosen):
        return jax.grad(lambda *w: fn(x, weights, chosen, *w).sum(), argnums=(0, 1, 2))(w_gate, w_up, w_down)

    for skew in (0.0, 50.0):
        weights, chosen = route_topk(x @ router + skew * (jnp.arange(8) == 5), 2, True)
        load = np.bincount(np.asarray(chosen).ravel(), minlength=8).max()
        assert load == 64 if skew else load <= 24, load
        args = (x, weights, chosen, w_gate, w_up, w_down)
        assert steps_apart(rounds_experts(*args), dense_experts(*args)) < 16
        for g, w in zip(grads(rounds_experts, weights, chosen), grads(dense_experts, weights, chosen), strict=True):
            assert np.abs(np.asarray(w)).max() > 0 and steps_apart(g, w) < 64


# ---------------------------------------------------------------- capacity factor


def numpy_within_capacity(chosen: np.ndarray, n_experts: int, capacity: int) -> np.ndarray:
    """The reference: walk the assignments token by token (slot by slot within a token), each expert keeping its
    first `capacity`."""
    taken = np.zeros(n_experts, int)
    keep = np.zeros(chosen.shape, bool)
    for t in range(chosen.shape[0]):
        for j in range(chosen.shape[1]):
            e = chosen[t, j]
            if e < n_experts and taken[e] < capacity:
                keep[t, j], taken[e] = True, taken[e] + 1
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_the_capacity_form_keeps_each_experts_first_assignments_and_equals_the_reference_on_them(factor):
    """`within_capacity` keeps what the NumPy walk keeps (some dropped at every factor here, some kept);
    `capacity_experts` equals the dense reference with the dropped assignments' gate weights at 0, and
    `tiled_experts` on the kept assignments alone, outputs and gradients."""
    args = problem()
    weights, chosen = route_topk(args[0] @ args[1], 2, True)
    capacity = expert_capacity(96, 2, 8, factor)
    assert capacity == int(np.ceil(factor * 96 * 2 / 8))
    kept = np.asarray(within_capacity(chosen, 8, capacity))
    assert np.array_equal(kept, numpy_within_capacity(np.asarray(chosen), 8, capacity))
    assert (~kept).sum() > 0 and kept.sum() >= min(capacity, 12) * 8 * 0.5  # some dropped, most experts full
    masked = jnp.where(kept, weights, 0.0)

    def capacity_kernel(*a):
        return capacity_experts(*a, capacity=capacity)

    def reference(x, weights, chosen, *w):  # the dense reference with the dropped assignments weighing 0
        return dense_experts(x, jnp.where(kept, weights, 0.0), chosen, *w)

    got = capacity_kernel(args[0], weights, chosen, *args[2:])
    want = reference(args[0], weights, chosen, *args[2:])
    tiled = tiled_experts(args[0], masked, jnp.where(kept, chosen, 8), *args[2:])
    assert steps_apart(got, want) < 16 and steps_apart(tiled, want) < 16
    grads = jax.grad(lambda *a: loss(capacity_kernel, 2, True, *a), argnums=range(5))(*args)
    wants = jax.grad(lambda *a: loss(reference, 2, True, *a), argnums=range(5))(*args)
    for name, g, w in zip(("x", "router", "w_gate", "w_up", "w_down"), grads, wants, strict=True):
        assert np.abs(np.asarray(w)).max() > 0, name
        assert steps_apart(g, w) < 64, (name, steps_apart(g, w))
