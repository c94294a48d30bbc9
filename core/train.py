"""One pure, jitted train step over a method's module tree, generic over the loss; its state; compile-only lowering.

The contract, shared by pretraining, SFT, DPO, GRPO, distillation and whatever comes next:

    loss_fn(modules, batch, rng) -> LossOutput(total, denominator, sums)

`modules` is the method's module tree, merged from its trainable and its frozen state: a `Decoder` for most
methods; for others a module holding the trained `Decoder` as `.model` beside modules trained with it and frozen
models. What trains is a filter over that tree (`trainable`, a Flax NNX filter: `nnx.Param`, or `nnx.LoRAParam`
for a model with LoRA adapters, or whatever a method composes); the rest (a frozen model, a LoRA base) is frozen
state the step reads under a stop-gradient and never updates, donates or checkpoints.

`total` is a *sum* over the micro-batch (e.g. of per-token NLL) and `denominator` the count it is normalised by
(e.g. target tokens, pairs). The step sums both over micro-batches and divides once, so k micro-batches give the
gradient of one big batch exactly. `sums` is a typed
record (`core.sums`) whose fields say how they combine over micro-batches (sum or max); the step returns it
combined, as sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.batch import CompiledCounts, packing_groups, with_compact, with_scored
from core.distributed import place_rows
from core.mesh import logical_to_spec, row_shards
from core.optim import global_norm
from core.router_loss import add_router_terms, capture_router, router_metrics, sown_at
from core.sums import NoSums, combine, identity, means

T = TypeVar("T")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LossOutput:
    """What a loss returns for one micro-batch: its summed loss, the count it is normalised by, and a typed
    record of its other sums (`core.sums`)."""

    total: Any  # float32 scalar: the loss summed over the micro-batch's items
    denominator: Any  # float32 scalar: how many items (target tokens, pairs) the global loss is a mean over
    sums: Any = field(default_factory=NoSums)  # a registered dataclass of `summed` / `maximum` fields (`core.sums`)
    # The trained model's routers over the micro-batch (`core.models.moe.RouterStats`, a mixture-of-experts model;
    # None for a dense one), set by the step around the loss (`core.router_loss`), not by the loss.
    router: Any = None


# (modules, batch, rng) -> LossOutput: the method's module tree, its batch, and the step's key for LoRA's dropout
# (None in evaluation: no dropout).
LossFn = Callable[[Any, Any, jax.Array | None], LossOutput]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Update:
    """One optimizer update's outcome: device arrays in the step, floats once `Learner.update` returns it."""

    loss: Any  # the loss, divided by the global denominator
    grad_norm: Any
    denominator: Any  # the global denominator (at least 1)
    finite: Any  # 1 when the loss and the gradient norm are finite (else the update was not applied)
    empty: Any  # 1 when the denominator was 0: nothing to learn from, no update
    sums: Any  # S, combined over the micro-batches (sums, not means)
    learning_rate: Any = None  # at this update (None without a schedule)
    router: Any = None  # the trained model's `RouterStats` summed over the micro-batches (an MoE model; else None)

    @property
    def applied(self) -> bool:
        return bool(self.finite) and not bool(self.empty)

    def metrics(self) -> dict[str, float]:
        """What the logs show: loss, gradient norm, learning rate and the sums per denominator."""
        out = {"loss": float(self.loss), "grad_norm": float(self.grad_norm)}
        if self.learning_rate is not None:
            out["learning_rate"] = float(self.learning_rate)
        out.update(means(self.sums, float(self.denominator)))
        if self.router is not None:
            out.update(router_metrics(self.router))
        return out


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    params: nnx.State  # the trainable part of the method's module tree
    opt_state: Any
    step: jax.Array  # int32 scalar: train steps taken (skipped non-finite steps included)
    rng: jax.Array  # PRNG key for dropout-like randomness in the loss


def split_modules(modules: nnx.Module, trainable: Any) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, the trainable state, the rest: frozen parameters and any other variables) of a module tree."""
    graphdef, params, rest = nnx.split(modules, trainable, ...)  # type: ignore[misc]
    if not jax.tree.leaves(params):
        raise ValueError(f"the trainable filter {trainable!r} selects no parameter of the {type(modules).__name__}")
    return graphdef, params, rest


def init_train_state(params: nnx.State, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """The optimizer state of `params` (the trainable state), sharded like the parameters it tracks. Parameters
    of `jax.ShapeDtypeStruct`s give an abstract state (shapes and shardings)."""
    shardings = optimizer_state_shardings(tx, params)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        # An abstract model (`core.models.abstract_sharded_state`): the state's shapes and shardings only, to
        # compile the step without allocating it (`core.compile_only`).
        abstract = jax.eval_shape(tx.init, params)
        opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    else:
        opt_state = jax.jit(tx.init, out_shardings=shardings)(params)
    replicated = _replicated_like(params)
    step, rng = jax.device_put((jnp.zeros((), jnp.int32), jax.random.key(seed)), replicated)
    return TrainState(params, opt_state, step, rng)


def bind_loss(graphdef: nnx.GraphDef, loss_fn: LossFn, router_terms: bool = True) -> Callable[..., LossOutput]:
    """`(params, rest, batch, rng) -> loss_fn(modules, batch, rng)`: the trainable and the frozen state merged into
    the method's module tree, for the step and for evaluation alike. A mixture-of-experts model's router terms
    are added here, for every method (`core.router_loss`); not with `router_terms` False (an evaluation: its loss
    and perplexity are the method's alone)."""
    from core.models.build import trained_model, trained_model_path

    captured = capture_router(loss_fn)

    def bound(params, rest, batch, rng) -> LossOutput:
        modules = nnx.merge(graphdef, params, rest)
        out, sown = captured(modules, batch, rng)
        if not isinstance(out, LossOutput):
            raise TypeError(f"a loss must return core.train.LossOutput, not {type(out).__name__}")
        if not router_terms:
            return out
        return add_router_terms(out, trained_model(modules), sown_at(sown, trained_model_path(modules)))

    return bound


def optimizer_state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
    """Shardings for `tx.init(params)`: each moment like its parameter, scalars replicated.

    Needed because the optimizer's zeros do not depend on the parameters' values,
    so XLA would otherwise replicate them (8x the memory under fsdp=8). A state
    leaf is matched to the parameter whose key path is a suffix of its own.
    """
    by_path = {
        _path_key(path): (leaf.shape, leaf.sharding) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
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


def check_packing_groups(batch: Any, micro_batches: int) -> None:
    """Refuse a batch packed for another number of packing groups than `micro_batches`, naming both (its
    `target_index` is local to each of its own groups: cut otherwise, a micro-batch's targets would point at other
    rows)."""
    for where, groups in packing_groups(batch):
        if groups != micro_batches:
            raise ValueError(
                f"batch{where} was packed for {groups} packing group(s) but is split into {micro_batches} "
                f"micro-batch(es): pack it for the micro-batches it trains in"
            )


def split_micro_batches(
    batch: T,
    micro_batches: int,
    mesh: Mesh | None = None,
    counts: CompiledCounts | None = None,
    set_counts: bool = True,
) -> T:
    """Every leaf of a host batch (any pytree: a `core.batch.PackedBatch`, a method's batch) `[N, ...]` ->
    `[k, N / k, ...]`; names the leaf that does not divide, and refuses a batch packed for another number of
    packing groups (`check_packing_groups`). With `set_counts`, each `PackedBatch`'s `scored` and `compact`
    counts are set for these micro-batches (`core.batch.with_scored`, `with_compact`), the latter for the data
    shards of `mesh` (the mesh the batch will be placed on; None: one device), reusing those in `counts` where one
    fits; without, they stay as set (a learner's `core.shape_plan.ShapePlan` set them)."""
    check_packing_groups(batch, micro_batches)

    def split(path, x):
        if x.shape[0] % micro_batches:
            name = jax.tree_util.keystr(path)
            raise ValueError(f"batch{name} has {x.shape[0]} rows, not divisible by {micro_batches} micro-batches")
        return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])

    if set_counts:
        batch = with_compact(with_scored(batch, counts), None if mesh is None else dict(mesh.shape), counts)
    return jax.tree_util.tree_map_with_path(split, batch)


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
) -> Callable[..., tuple[TrainState, Update]]:
    """The pure step `(state, micro_batched_batch, rest) -> (state, Update)`, not yet jitted: `rest` is the frozen
    part of the module tree (`split_modules`), read under a stop-gradient.

    A step whose loss or gradient norm is not finite leaves the parameters and
    optimizer state unchanged (`finite == 0`); the loop decides to skip or
    abort. So does a step with nothing to learn from (a denominator of 0, e.g.
    a mini-batch whose every token is masked, `empty == 1`): an optimizer step
    on a zero gradient would still move AdamW's moments and apply weight decay.
    """

    bound = bind_loss(graphdef, loss_fn)

    def grads_of(params, rest, micro_batch, rng):
        objective = lambda p: _total(bound(p, rest, micro_batch, rng))
        (_, out), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return out, grads

    def summed(params, rest, batch, step_rng) -> tuple[LossOutput, Any]:
        """The loss output and the gradient summed over the micro-batches (float32)."""
        k = jax.tree.leaves(batch)[0].shape[0]
        to_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
        if k == 1:  # no accumulation buffers for the common case
            first = jax.tree.map(lambda x: x[0], batch)
            return to_f32(grads_of(params, rest, first, jax.random.fold_in(step_rng, 0)))
        shapes = jax.eval_shape(grads_of, params, rest, jax.tree.map(lambda x: x[0], batch), step_rng)
        out0, grads0 = shapes
        zeros: tuple[LossOutput, Any] = (
            LossOutput(
                jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32),
                identity(out0.sums),
                jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), out0.router),
            ),
            jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), grads0),
        )

        def accumulate(carry, inputs):
            micro_batch, i = inputs
            out_i, grads_i = to_f32(grads_of(params, rest, micro_batch, jax.random.fold_in(step_rng, i)))
            out, grads = carry
            total, denominator = out.total + out_i.total, out.denominator + out_i.denominator
            router = None if out.router is None else out.router + out_i.router
            out = LossOutput(total, denominator, combine(out.sums, out_i.sums), router)
            return (out, jax.tree.map(jnp.add, grads, grads_i)), None

        return jax.lax.scan(accumulate, zeros, (batch, jnp.arange(k)))[0]

    def step(state: TrainState, batch: Any, rest: Any) -> tuple[TrainState, Update]:
        rng, step_rng = jax.random.split(state.rng)
        rest = jax.lax.stop_gradient(rest)
        out, grads = summed(state.params, rest, batch, step_rng)
        has_items = out.denominator > 0
        denom = jnp.maximum(out.denominator, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = out.total / denom
        grad_norm = global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(operands):
            params, opt_state = operands
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        operands = (state.params, state.opt_state)
        # Only the taken branch runs: no extra pass over the state.
        params, opt_state = jax.lax.cond(finite & has_items, update, lambda ops: ops, operands)
        # The step counter advances even when an update is skipped: it indexes batches.
        new_state = TrainState(params, opt_state, state.step + 1, rng)
        report: Update = Update(
            loss=loss,
            grad_norm=grad_norm,
            denominator=denom,
            finite=finite.astype(jnp.float32),
            empty=(~has_items).astype(jnp.float32),
            sums=out.sums,
            learning_rate=None if schedule is None else jnp.asarray(schedule(state.step), jnp.float32),
            router=out.router,
        )
        return new_state, report

    return step


def _total(out: LossOutput) -> tuple[jax.Array, LossOutput]:
    return out.total, out


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
