"""`train.compile_only=true`: lower and compile the train step for the configured mesh, run nothing.

Parameters, optimizer state and the batch are abstract (`ShapeDtypeStruct`s
with shardings), so a full-size preset compiles on fake CPU devices without
allocating its weights. Prints XLA's memory analysis per device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.config import Config
from core.models import abstract_sharded_state
from core.optim import make_optimizer, make_schedule
from core.train import (
    LossFn,
    TrainState,
    batch_sharding,
    make_train_step,
    memory_analysis_line,
    optimizer_state_shardings,
)

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def compile_train_step(cfg: Config, loss_fn: LossFn, mesh: Mesh, batch_keys=BATCH_KEYS):
    """The compiled step (an XLA executable); prints and returns it."""
    graphdef, params = abstract_sharded_state(cfg.model, mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps, params)
    abstract_opt = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(tx.init, params),
        optimizer_state_shardings(tx, params),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = TrainState(
        params,
        abstract_opt,
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
    )
    k, b, t = cfg.train.micro_batches, cfg.train.batch_size // cfg.train.micro_batches, cfg.data.seq_len
    batch = {
        key: jax.ShapeDtypeStruct((k, b, t), jnp.int32, sharding=batch_sharding(mesh, (k, b, t))) for key in batch_keys
    }
    step = make_train_step(graphdef, loss_fn, tx, make_schedule(cfg.optim, cfg.train.steps))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=(0,)).lower(state, batch).compile()
    print(
        f"compile-only: {cfg.model.preset or cfg.model.family} on mesh {dict(mesh.shape)}, "
        f"batch {cfg.train.batch_size} x {t} in {k} micro-batch(es)"
    )
    print(memory_analysis_line(compiled), flush=True)
    return compiled
