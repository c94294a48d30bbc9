"""Devices -> `jax.sharding.Mesh`, and logical axis names -> mesh axes.

This is the only module that knows the mesh axis names. Model code names
logical axes (`embed`, `heads`, `mlp`, ...) and asks this module for a
`PartitionSpec`; swapping a parallelism strategy means editing `LOGICAL_RULES`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from core.config import MeshConfig, resolve_mesh_shape

MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")
EXPERT_AXIS = "expert"  # the axis a mixture-of-experts layer exchanges tokens over (core.models.moe)

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": "sequence",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "embed": ("fsdp", "expert"),  # the expert axis is a data axis to every dense weight: sharded ZeRO-3 style
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "experts": "expert",  # a mixture-of-experts layer's stacked experts (and its router's outputs)
    "norm": None,
    "lora_rank": None,  # a LoRA adapter's rank: small, kept whole
}

Logical = Sequence[str | None]


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes `MESH_AXES` sized from the config."""
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_mesh_shape(cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    return make_mesh(MeshConfig(fsdp=1), [device or jax.devices()[0]])


def logical_to_spec(
    axes: Logical,
    shape: Sequence[int] | None = None,
    mesh_shape: dict[str, int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for logical `axes`.

    With `shape` and `mesh_shape`, a mesh axis that does not divide its
    dimension is dropped (that dimension is replicated over it) instead of
    failing, and a mesh axis is never used twice in one spec.
    """
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        rule = LOGICAL_RULES.get(name) if name is not None else None
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_RULES)}")
        mesh_axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
        kept: list[str] = []
        for m in mesh_axes:
            if m in used:
                continue
            if shape is not None and mesh_shape is not None:
                size = mesh_shape.get(m, 1)
                if name == "experts" and size > 1 and shape[i] % size:
                    # Expert parallelism splits the experts whole: replicating them instead would leave the axis
                    # idle and the layer's token exchange without its experts.
                    raise ValueError(
                        f"mesh.expert ({size}) does not divide the {shape[i]} experts (model.moe.num_experts)"
                    )
                if size == 1 or shape[i] % (size * math.prod(mesh_shape[k] for k in kept)):
                    continue
            kept.append(m)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, axes: Logical, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, dict(mesh.shape)))


def constrain(x: jax.Array, axes: Logical) -> jax.Array:
    """Sharding constraint on an activation when a mesh is set (`jax.set_mesh`); identity otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(axes, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)


def row_shards(rows: int, mesh_shape: dict[str, int] | None = None) -> int:
    """Into how many parts the `batch` axis of `rows` rows is split over a mesh of `mesh_shape` (default: the
    mesh set with `jax.set_mesh`; 1 without one): the product of the data axes that divide it."""
    if mesh_shape is None:
        mesh = jax.sharding.get_abstract_mesh()
        mesh_shape = {} if mesh.empty else dict(mesh.shape)
    if not mesh_shape:
        return 1
    return math.prod(mesh_shape[a] for a in spec_axes(logical_to_spec(("batch",), (rows,), mesh_shape)[0]))


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def split_devices(
    devices: Sequence[jax.Device],
    trainer_fraction: float,
    sampler_fraction: float,
) -> tuple[list[jax.Device], list[jax.Device]]:
    """Disjoint (trainer, sampler) device lists: the RL device split.

    Each side gets `round(fraction * n)` devices, trainer first. A positive
    fraction always gets at least one device; asking for more than exist fails.
    """
    devices = list(devices)
    n = len(devices)
    for name, frac in (("trainer", trainer_fraction), ("sampler", sampler_fraction)):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"{name} fraction must be in [0, 1], got {frac}")
    if trainer_fraction + sampler_fraction > 1.0 + 1e-9:
        raise ValueError(f"trainer fraction {trainer_fraction} + sampler fraction {sampler_fraction} > 1")

    def count(frac: float) -> int:
        return 0 if frac == 0 else max(1, round(frac * n))

    n_train, n_sample = count(trainer_fraction), count(sampler_fraction)
    if n_train + n_sample > n:
        raise ValueError(
            f"cannot give the trainer {n_train} and the samplers {n_sample} devices "
            f"(fractions {trainer_fraction}/{sampler_fraction}) out of {n}"
        )
    if n_train == 0:
        raise ValueError(f"trainer fraction {trainer_fraction} leaves the trainer no device of {n}")
    return devices[:n_train], devices[n_train : n_train + n_sample]
