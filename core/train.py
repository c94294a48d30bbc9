"""One pure, jitted train step, generic over the loss; its state; compile-only lowering.

The loss contract, shared by pretraining, SFT, DPO, GRPO and distillation:

    loss_fn(model, batch, rng) -> (loss_sum, metrics)
    loss_fn(model, batch, rng, frozen) -> (loss_sum, metrics)      # with a frozen model in the step (a teacher)
    loss_fn(model, batch, rng, frozen, companion) -> ...           # and a module trained beside the model
                                                                   # (frozen None when there is none)

`loss_sum` is a *sum* over the micro-batch (e.g. of per-token NLL) and
`metrics["loss_denominator"]` the count it is normalised by (e.g. target
tokens). The step sums both over micro-batches and divides once, so k
micro-batches give the gradient of one big batch exactly. Every other metric is
also a sum, reported divided by the same global denominator, except those named
`max/...`: maxima, combined by max over micro-batches and reported as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.batch import with_compact, with_scored
from core.distributed import place_rows
from core.mesh import logical_to_spec, row_shards
from core.optim import global_norm

# loss_fn(model, batch, rng[, frozen]) -> (loss_sum, sums): `batch` is the method's typed batch (a pytree of
# arrays); `frozen` a model that runs in the step without being differentiated (online distillation's teacher).
LossFn = Callable[..., tuple[jax.Array, dict]]
T = TypeVar("T")
MAX_PREFIX = "max/"  # metrics reduced by max, not summed and normalised


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    params: nnx.State
    opt_state: Any
    step: jax.Array  # int32 scalar: train steps taken (skipped non-finite steps included)
    rng: jax.Array  # PRNG key for dropout-like randomness in the loss
    # Parameters trained with the model's but not part of it (a feature-distillation projection): checkpointed
    # with the state, never exported, synced or read as the model. None for most methods.
    companion: nnx.State | None = None

    @property
    def trainable(self) -> Any:
        """What the optimizer updates: the model's parameters, or (them, the companion's)."""
        return self.params if self.companion is None else (self.params, self.companion)


def init_train_state(
    model: nnx.Module, tx: optax.GradientTransformation, seed: int, companion: nnx.State | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """Split the model and create the optimizer state sharded like the parameters it tracks (`tx` takes
    `TrainState.trainable`: the pair with a `companion`). A model of `jax.ShapeDtypeStruct`s gives an abstract
    state (shapes and shardings)."""
    graphdef, params = nnx.split(model)
    trainable = params if companion is None else (params, companion)
    shardings = optimizer_state_shardings(tx, trainable)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(trainable)):
        # An abstract model (`core.models.abstract_sharded_state`): the state's shapes and shardings only, to
        # compile the step without allocating it (`core.compile_only`).
        abstract = jax.eval_shape(tx.init, trainable)
        opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    else:
        opt_state = jax.jit(tx.init, out_shardings=shardings)(trainable)
    replicated = _replicated_like(params)
    step, rng = jax.device_put((jnp.zeros((), jnp.int32), jax.random.key(seed)), replicated)
    return graphdef, TrainState(params, opt_state, step, rng, companion)


def bind_loss(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    frozen_graphdef: nnx.GraphDef | None = None,
    companion_graphdef: nnx.GraphDef | None = None,
) -> Callable[..., tuple[jax.Array, dict]]:
    """`(trainable, batch, rng, frozen_params) -> loss_fn(...)`: the parameters merged into the modules the loss
    contract names (the model; the frozen model; the companion), for the step and for evaluation alike."""

    def bound(trainable, batch, rng, frozen):
        params, companion = (trainable, None) if companion_graphdef is None else trainable
        args = [nnx.merge(graphdef, params), batch, rng]
        if frozen_graphdef is not None or companion_graphdef is not None:
            args.append(None if frozen_graphdef is None else nnx.merge(frozen_graphdef, frozen))
        if companion_graphdef is not None:
            args.append(nnx.merge(companion_graphdef, companion))
        return loss_fn(*args)

    return bound


def optimizer_state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
    """Shardings for `tx.init(params)`: each moment like its parameter, scalars replicated.

    Needed because the optimizer's zeros do not depend on the parameters' values,
    so XLA would otherwise replicate them (8x the memory under fsdp=8). A state
    leaf is matched to the parameter whose key path is a suffix of its own.
    """
    parts = params if isinstance(params, tuple) else (params,)  # (the model's, a companion's): each on its own
    by_path = {
        _path_key(path): (leaf.shape, leaf.sharding)
        for part in parts
        for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]
    }
    replicated = _replicated_like(params)

    def pick(path, leaf):
        keys = _path_key(path)
        for i in range(len(keys)):
            found = by_path.get(keys[i:])
            if found is not None and found[0] == leaf.shape:
                return found[1]
        return replicated

    abstract = jax.eval_shape(tx.init, params)
    return jax.tree_util.tree_map_with_path(pick, abstract)


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def _replicated_like(params: Any) -> NamedSharding:
    first = jax.tree.leaves(params)[0].sharding
    return NamedSharding(first.mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of a micro-batched input `[k, B/k, ...]`: the batch axis over the data axes
    (those that divide B/k)."""
    spec = logical_to_spec(("batch",), shape[1:2], dict(mesh.shape))
    return NamedSharding(mesh, PartitionSpec(None, *spec, *([None] * (len(shape) - 2))))


def batch_shards(mesh: Mesh) -> int:
    """Into how many parts `batch_sharding` can split the batch axis at most (the data-parallel size):
    a micro-batch's row count divisible by it is never replicated across those devices."""
    shape = dict(mesh.shape)
    return row_shards(math.prod(shape.values()), shape)


def split_micro_batches(batch: T, micro_batches: int, mesh: Mesh | None = None) -> T:
    """Every leaf of a host batch (any pytree: a `core.batch.PackedBatch`, a method's batch) `[N, ...]` ->
    `[k, N / k, ...]`; names the leaf that does not divide. Each `PackedBatch`'s `scored` and `compact` counts
    are set for these micro-batches (`core.batch.with_scored`, `with_compact`), the latter for the data shards
    of `mesh` (the mesh the batch will be placed on; None: one device)."""

    def split(path, x):
        if x.shape[0] % micro_batches:
            name = jax.tree_util.keystr(path)
            raise ValueError(f"batch{name} has {x.shape[0]} rows, not divisible by {micro_batches} micro-batches")
        return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])

    counted = with_compact(with_scored(batch, micro_batches), micro_batches, None if mesh is None else dict(mesh.shape))
    return jax.tree_util.tree_map_with_path(split, counted)


def place_batch(batch: T, mesh: Mesh) -> T:
    """A micro-batched host batch on `mesh`, each leaf's batch axis over the data axes (`batch_sharding`). In a
    JAX process group every process holds the same host batch and places only the rows its devices hold
    (`core.distributed.place_rows`)."""
    return jax.tree.map(lambda x: place_rows(x, batch_sharding(mesh, x.shape), axis=1), batch)


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
    frozen_graphdef: nnx.GraphDef | None = None,
    companion_graphdef: nnx.GraphDef | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
    """The pure step `(state, micro_batched_batch, frozen_params) -> (state, metrics)`, not yet jitted.

    With `frozen_graphdef`, `frozen_params` (its parameters, never updated) are merged into a model the loss
    receives as its fourth argument, under a stop-gradient; without, they are None and the loss takes three.
    With `companion_graphdef`, `state.companion` is merged into a module the loss receives fifth, and trained
    with the model (`bind_loss`).

    A step whose loss or gradient norm is not finite leaves the parameters and
    optimizer state unchanged (`metrics["finite"] == 0`); the loop decides to
    skip or abort. So does a step with nothing to learn from (a loss
    denominator of 0, e.g. a mini-batch whose every token is masked,
    `metrics["empty"] == 1`): an optimizer step on a zero gradient would still
    move AdamW's moments and apply weight decay.
    """

    bound = bind_loss(graphdef, loss_fn, frozen_graphdef, companion_graphdef)

    def grads_of(trainable, micro_batch, rng, frozen):
        objective = lambda t: bound(t, micro_batch, rng, frozen)
        (loss_sum, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
        return loss_sum, metrics, grads

    def summed(trainable, batch, step_rng, frozen):
        """Loss, metric and gradient sums over the micro-batches (float32)."""
        k = jax.tree.leaves(batch)[0].shape[0]
        to_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
        if k == 1:  # no accumulation buffers for the common case
            first = jax.tree.map(lambda x: x[0], batch)
            return to_f32(grads_of(trainable, first, jax.random.fold_in(step_rng, 0), frozen))
        shapes = jax.eval_shape(grads_of, trainable, jax.tree.map(lambda x: x[0], batch), step_rng, frozen)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
        zeros[1].update({k: jnp.full((), -jnp.inf) for k in zeros[1] if k.startswith(MAX_PREFIX)})

        def accumulate(carry, inputs):
            micro_batch, i = inputs
            out = to_f32(grads_of(trainable, micro_batch, jax.random.fold_in(step_rng, i), frozen))
            (loss, metrics, grads), (loss_i, metrics_i, grads_i) = carry, out
            metrics = {
                k: (jnp.maximum if k.startswith(MAX_PREFIX) else jnp.add)(v, metrics_i[k]) for k, v in metrics.items()
            }
            return (loss + loss_i, metrics, jax.tree.map(jnp.add, grads, grads_i)), None

        return jax.lax.scan(accumulate, zeros, (batch, jnp.arange(k)))[0]

    def step(state: TrainState, batch: Any, frozen: Any = None) -> tuple[TrainState, dict]:
        rng, step_rng = jax.random.split(state.rng)
        frozen = jax.lax.stop_gradient(frozen)
        loss_sum, sums, grads = summed(state.trainable, batch, step_rng, frozen)
        raw_denom = sums.pop("loss_denominator")
        has_tokens = raw_denom > 0
        denom = jnp.maximum(raw_denom, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = loss_sum / denom
        grad_norm = global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(operands):
            trainable, opt_state = operands
            updates, opt_state = tx.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state

        operands = (state.trainable, state.opt_state)
        # Only the taken branch runs: no extra pass over the state.
        trainable, opt_state = jax.lax.cond(finite & has_tokens, update, lambda ops: ops, operands)
        params, companion = (trainable, None) if state.companion is None else trainable
        # The step counter advances even when an update is skipped: it indexes batches.
        new_state = TrainState(params, opt_state, state.step + 1, rng, companion)
        metrics = {k: v if k.startswith(MAX_PREFIX) else v / denom for k, v in sums.items()}
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            tokens=denom,
            finite=finite.astype(jnp.float32),
            empty=(~has_tokens).astype(jnp.float32),
        )
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        return new_state, metrics

    return step


def jit_train_step(step: Callable, state: TrainState) -> Any:
    """jit with the state donated and kept in its current shardings."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None))


def memory_analysis_line(compiled) -> str:
    """XLA's memory analysis of a compiled step, in one line."""
    m = compiled.memory_analysis()
    if m is None:
        return "memory analysis: not available on this backend"
    gib = 2**30
    arg, out, tmp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = getattr(m, "alias_size_in_bytes", 0)
    total = arg + out + tmp - alias
    return (
        f"memory analysis: arguments {arg / gib:.3f} GiB, outputs {out / gib:.3f} GiB, "
        f"temp {tmp / gib:.3f} GiB, aliased {alias / gib:.3f} GiB, total {total / gib:.3f} GiB per device"
    )
