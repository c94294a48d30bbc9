"""Saves checkpoint 1, then starts an asynchronous save of checkpoint 2 of a large state and says so on stdout
(the parent kills this process at that moment: tests/test_checkpoint.py)."""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from core.checkpoint import Checkpointer
from core.config import Config, ModelConfig
from core.train import TrainState

if __name__ == "__main__":
    directory = sys.argv[1]
    params = nnx.State({"w": jnp.ones((2048, 8192), jnp.float32)})  # 64 MiB: the async write takes a while
    state = TrainState(params, {"m": jnp.zeros((4,))}, jnp.asarray(1, jnp.int32), jax.random.key(0))
    ckpt = Checkpointer(directory, keep=3, async_save=True)
    ckpt.save(state, None, Config(model=ModelConfig()))
    ckpt.wait()
    state = TrainState(nnx.State({"w": params["w"] * 2}), state.opt_state, state.step + 1, state.rng)
    ckpt.save(state, None, Config(model=ModelConfig()))
    # The write runs in a background thread: say "saving" once it has started (its temporary directory exists),
    # so that the parent's kill lands mid-save and not before it (which a loaded machine made happen).
    deadline = time.monotonic() + 30
    while not any("tmp" in p.name for p in Path(directory).iterdir()) and time.monotonic() < deadline:
        time.sleep(0.005)
    print("saving", flush=True)
    time.sleep(60)
