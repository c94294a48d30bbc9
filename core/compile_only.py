"""`train.compile_only=true`: the update a method trains with, lowered and compiled for the configured mesh; nothing
runs.

    compile_method(cfg, PRETRAINING)          # python -m recipes.pretrain CONFIG.yml train.compile_only=true
    compile_update(cfg, learner, batch, what) # any method's Learner (GRPO's policy learner: posttrain.grpo)

The step is the one the run executes: the method's loss inside `core.learner.Learner` (its jit, donation and
shardings, the scored and compacted targets of a packed batch), on a host batch of the configured shapes made by
the method's own batch builder (`Method.example_batch`); only the parameters and the optimizer state are abstract
(shapes and shardings), so a full-size preset compiles on fake CPU devices without allocating its weights. It
prints XLA's memory analysis per device. Frozen models that run outside the update (a live reference's log-probs)
are not part of it.
"""

from __future__ import annotations

import math
from typing import Any

from flax import nnx

from core.batch import TrainBatch
from core.config import Config
from core.learner import Learner
from core.mesh import make_mesh
from core.method import Method
from core.method_learner import build_learner
from core.models import Decoder, abstract_sharded_state
from core.train import batch_shards


def refuse(cfg: Config, what: str, instead: str) -> None:
    """`train.compile_only=true` where a recipe does not compile its update (`what` it would run instead, and what to
    compile `instead`): a `ConfigError` before anything loads, never a real run."""
    from core.config_loader import ConfigError

    if cfg.train.compile_only:
        raise ConfigError(f"train.compile_only=true is not offered for {what}: {instead}")


def request_devices(cfg: Config) -> None:
    """Fake CPU devices for the configured mesh (before JAX's first device query)."""
    from core.host_devices import request_host_devices

    request_host_devices(math.prod(v for v in cfg.mesh.axis_sizes().values() if v > 0))


def sharded_abstract_model(cfg: Config, mesh: Any) -> Decoder:
    """The configured model with abstract parameters (shapes and shardings on `mesh`): allocates nothing."""
    graphdef, state = abstract_sharded_state(cfg.model, mesh)
    return nnx.merge(graphdef, state)


def compile_update(cfg: Config, learner: Learner, batch: TrainBatch, what: str) -> str:
    """Compile `learner`'s update for `batch` in `train.micro_batches`; print and return XLA's memory analysis."""
    line = learner.compile(batch, cfg.train.micro_batches)
    rows, length = batch.packed.tokens.shape
    print(
        f"compile-only: {what} step, {cfg.model.preset or cfg.model.family} on mesh {dict(learner.mesh.shape)}, "
        f"{rows} packed rows x {length} tokens in {cfg.train.micro_batches} micro-batch(es)"
    )
    print(line, flush=True)
    return line


def compile_method(cfg: Config, method: Method) -> str:
    """An offline method's update (`method.loss`) on its own example batch, compiled; XLA's memory analysis."""
    mesh = make_mesh(cfg.mesh)
    model = sharded_abstract_model(cfg, mesh)
    learner = build_learner(cfg, method, model, mesh, compile_ahead=False)
    return compile_update(cfg, learner, method.example_batch(cfg, batch_shards(mesh)), method.name)
