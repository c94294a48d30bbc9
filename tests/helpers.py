"""Small helpers several test modules share."""

from __future__ import annotations

import jax
import numpy as np
import optax


def recording_sgd(learning_rate: float):
    """SGD whose state is the last gradient it was given, so a test can read every update's gradient."""

    def update(grads, state, params=None):
        return jax.tree.map(lambda g: -learning_rate * g, grads), grads

    return optax.GradientTransformation(lambda params: jax.tree.map(jax.numpy.zeros_like, params), update)


def assert_same_gradients(a, b, steps: float = 32.0) -> None:
    """Two gradient pytrees equal to within `steps` float32 steps (ulps) at each tensor's largest entry."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        scale = max(float(np.abs(x).max()), float(np.finfo(np.float32).tiny))
        assert float(np.abs(x - y).max()) <= steps * float(np.spacing(np.float32(scale))), (x.shape, scale)
