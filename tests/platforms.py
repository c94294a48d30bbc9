"""Which platforms JAX may use in a test session, decided before JAX is imported (`tests/conftest.py`).

The suite's default is the CPU with 8 fake devices, even on a machine with a GPU: the mesh tests are written for
them. A session that selects the `gpu_only` tests (`make test-gpu`: `pytest -m gpu_only`) leaves JAX to find the
accelerator, which then becomes the default backend those tests run on; otherwise `JAX_PLATFORMS` stayed `cpu`
and every `gpu_only` test skipped, on a GPU machine too. A `JAX_PLATFORMS` the caller set is kept as it is.
"""

from __future__ import annotations

from collections.abc import Mapping


def jax_platforms(markexpr: str, env: Mapping[str, str]) -> str | None:
    """The `JAX_PLATFORMS` a session sets for a `-m` expression: None to leave it as it is (set by the caller, or
    unset for a `gpu_only` session so that JAX picks the GPU), else "cpu"."""
    if "JAX_PLATFORMS" in env:
        return None
    selects_gpu = "gpu_only" in markexpr and "not gpu_only" not in markexpr
    return None if selects_gpu else "cpu"
