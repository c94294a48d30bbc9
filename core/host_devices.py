"""Fake CPU devices for compile-only runs: they stand in for a larger topology."""

from __future__ import annotations

import os


def request_host_devices(count: int) -> None:
    """Ask XLA's CPU backend for `count` devices.

    Works until JAX initialises its backends (the first device query), so call
    it before anything touches `jax.devices()`; fails loudly if that was too late.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    import jax

    if jax.devices()[0].platform == "cpu" and jax.device_count() < count:
        raise RuntimeError(
            f"{count} devices are needed but JAX started with {jax.device_count()}; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before starting Python"
        )


def with_host_device_count(flags: str, count: int) -> str:
    """`flags` (an XLA_FLAGS value) asking for `count` CPU devices, in place of any count it asked for."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])
