"""A readable table of a model's parameters: path, shape, dtype, logical axes, sharding, size.

Printed at start-up when `mesh.debug_sharding` is on; callable on any model,
concrete or abstract (`core.models.abstract_model`) with a mesh to plan on.
"""

from __future__ import annotations

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from core.mesh import logical_to_spec


def parameter_summary(model: nnx.Module, mesh: Mesh | None = None) -> str:
    """The table as text. The sharding column is the array's own, or planned on `mesh`."""
    rows = []
    total_count = total_bytes = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        axes = tuple(var.get_metadata("logical_axes"))
        sharding = getattr(value, "sharding", None)
        if mesh is not None:
            spec = logical_to_spec(axes, value.shape, dict(mesh.shape))
        elif sharding is not None and hasattr(sharding, "spec"):
            spec = sharding.spec
        else:
            spec = "-"  # type: ignore[assignment]  # unsharded: printed as is
        count = int(np.prod(value.shape))
        nbytes = count * np.dtype(value.dtype).itemsize
        total_count += count
        total_bytes += nbytes
        rows.append(
            (
                ".".join(map(str, path)),
                str(tuple(value.shape)),
                str(np.dtype(value.dtype)),
                str(axes),
                str(spec),
                f"{count:,}",
            )
        )
    header = ("parameter", "shape", "dtype", "logical axes", "sharding", "size")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    lines.append(f"total: {total_count:,} parameters, {total_bytes / 2**20:,.1f} MiB")
    return "\n".join(lines)
