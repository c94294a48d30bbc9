"""`train.compile_only=true`: lower and compile the train step for the configured mesh, run nothing.

Parameters, optimizer state and the batch are abstract (`ShapeDtypeStruct`s
with shardings), so a full-size preset compiles on fake CPU devices without
allocating its weights. Prints XLA's memory analysis per device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from core.batch import PackedBatch
from core.config import Config
from core.losses import nll_loss
from core.mesh import make_mesh
from core.models import abstract_sharded_state
from core.optim import make_optimizer, make_schedule
from core.train import (
    TrainState,
    batch_sharding,
    make_train_step,
    memory_analysis_line,
    optimizer_state_shardings,
)


def compile_train_step(cfg: Config):
    """The compiled next-token step (an XLA executable) for the configured model, mesh and batch; prints and
    returns it."""
    mesh = make_mesh(cfg.mesh)
    graphdef, params = abstract_sharded_state(cfg.model, mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps, params)
    abstract_opt = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(tx.init, params),
        optimizer_state_shardings(tx, params),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = TrainState(  # abstract leaves: the step is lowered, never run
        params,
        abstract_opt,
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),  # type: ignore[arg-type]
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),  # type: ignore[arg-type]
    )
    k, b, t = cfg.train.micro_batches, cfg.train.batch_size // cfg.train.micro_batches, cfg.data.seq_len

    def spec(dtype):  # one [k, b, t] leaf, its batch axis sharded like a real batch's
        return jax.ShapeDtypeStruct((k, b, t), dtype, sharding=batch_sharding(mesh, (k, b, t)))

    ints = [spec(jnp.int32) for _ in range(6)]
    batch = PackedBatch(
        tokens=ints[0],
        positions=ints[1],
        segment_ids=ints[2],
        branch_ids=ints[3],
        target_index=ints[4],
        target_ids=ints[5],
        target_mask=spec(jnp.float32),
    )
    step = make_train_step(graphdef, nll_loss, tx, make_schedule(cfg.optim, cfg.train.steps))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=(0,)).lower(state, batch).compile()
    print(
        f"compile-only: {cfg.model.preset or cfg.model.family} on mesh {dict(mesh.shape)}, "
        f"batch {cfg.train.batch_size} x {t} in {k} micro-batch(es)"
    )
    print(memory_analysis_line(compiled), flush=True)
    return compiled
