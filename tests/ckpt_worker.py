"""Saves checkpoint 1, then starts an asynchronous save of checkpoint 2 of a large state and says so on stdout
(the parent kills this process at that moment: tests/test_checkpoint.py)."""

import sys
import time

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
    print("saving", flush=True)
    time.sleep(60)
