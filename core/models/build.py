"""Create core models: abstractly (shapes only), randomly initialised, or from given parameters,
always with every parameter placed according to its logical axes on a mesh."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from core.config import ModelConfig
from core.mesh import named_sharding, single_device_mesh
from core.models.decoder import Decoder


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The model with `jax.ShapeDtypeStruct` leaves: allocates nothing (works for 8B presets)."""
    return nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(params=0)))


def abstract_sharded_state(cfg: ModelConfig, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and a State of `ShapeDtypeStruct`s carrying each parameter's sharding on
    `mesh`: a compile or restore target that allocates nothing."""
    model = abstract_model(cfg)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        state,
        state_shardings(model, mesh),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return graphdef, state


def logical_axes(model: nnx.Module) -> dict[tuple, tuple]:
    """Parameter path -> logical axis names, read from each parameter's metadata."""
    return {
        path: tuple(var.get_metadata("logical_axes"))
        for path, var in nnx.iter_graph(model)
        if isinstance(var, nnx.Variable)
    }


def state_shardings(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """A State of `NamedSharding`s mirroring the model's parameters."""

    return _shardings_of(nnx.state(model), mesh)


def _shardings_of(state: nnx.State, mesh: Mesh) -> nnx.State:
    def to_sharding(var) -> NamedSharding:
        return named_sharding(mesh, var.get_metadata("logical_axes"), var.shape)

    return jax.tree.map(to_sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_model(cfg: ModelConfig, mesh: Mesh | None = None, seed: int = 0) -> Decoder:
    """A randomly initialised model whose parameters are created directly in their shards (with `model.lora`: a
    random base and its adapters, `core.models.adapters.add_adapters`)."""
    mesh = mesh or single_device_mesh()
    if cfg.lora is not None:
        from core.models.adapters import add_adapters

        base = create_model(cfg.model_copy(update={"lora": None}), mesh, seed)
        return add_adapters(base, cfg.lora, mesh, seed)
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    shardings = _shardings_of(abstract_state, mesh)

    @jax.jit
    def init():
        return nnx.state(Decoder(cfg, nnx.Rngs(params=seed)))

    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def model_from_arrays(cfg: ModelConfig, arrays: dict[tuple, Any], mesh: Mesh | None = None) -> Decoder:
    """A model whose parameters are `arrays` (path -> host array), placed on `mesh`.

    Raises one error listing every missing, unexpected or wrongly shaped path.
    """
    mesh = mesh or single_device_mesh()
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    flat = dict(nnx.to_flat_state(abstract_state))
    problems = []
    missing = sorted(set(flat) - set(arrays))
    unexpected = sorted(set(arrays) - set(flat))
    if missing:
        problems.append("missing: " + ", ".join(".".join(map(str, p)) for p in missing))
    if unexpected:
        problems.append("unexpected: " + ", ".join(".".join(map(str, p)) for p in unexpected))
    for path, var in flat.items():
        if path in arrays and tuple(arrays[path].shape) != tuple(var.shape):
            problems.append(
                f"shape mismatch for {'.'.join(map(str, path))}: expected {tuple(var.shape)}, "
                f"got {tuple(arrays[path].shape)}"
            )
    if problems:
        raise ValueError("parameters do not match the model:\n  " + "\n  ".join(problems))
    for path, var in flat.items():
        value = np.asarray(arrays[path]).astype(var.dtype)
        sharding = named_sharding(mesh, var.get_metadata("logical_axes"), var.shape)
        flat[path] = var.replace(jax.device_put(value, sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an existing model's parameters onto `mesh` according to their logical axes (in place)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, _shardings_of(state, mesh)))
    return model


def state_mismatches(expected: nnx.State, given: nnx.State, check_dtype: bool = True) -> list[str]:
    """Every path missing from, unexpected in, or of another shape (or dtype) in `given`; empty if they match."""
    old, new = dict(nnx.to_flat_state(expected)), dict(nnx.to_flat_state(given))
    name = lambda k: ".".join(map(str, k))
    problems = [f"missing {name(k)}" for k in old.keys() - new.keys()]
    problems += [f"unexpected {name(k)}" for k in new.keys() - old.keys()]
    for k in old.keys() & new.keys():
        a, b = old[k].get_value(), new[k].get_value()
        if a.shape != b.shape or (check_dtype and a.dtype != b.dtype):
            problems.append(f"{name(k)}: expected {a.shape} {a.dtype}, got {b.shape} {b.dtype}")
    return sorted(problems)


class ModuleTree(nnx.Module):
    """A method's module tree (`core.train`) that holds the `Decoder` it trains as `.model`, beside what its loss
    also reads (modules trained with it, frozen models): a subclass adds those."""

    def __init__(self, model: Decoder):
        self.model = model


def trained_model(modules: Decoder | ModuleTree) -> Decoder:
    """The model a method's module tree trains: the tree itself when it is a `Decoder`, else its `.model`."""
    if isinstance(modules, Decoder):
        return modules
    if not isinstance(modules, ModuleTree):
        raise TypeError(
            f"a method's module tree is a Decoder or a core.models.ModuleTree holding one; not {type(modules).__name__}"
        )
    return modules.model


def trained_model_path(modules: Decoder | ModuleTree) -> list[str]:
    """Where `trained_model` sits in the tree: the tree itself, or its `.model` (what a checkpoint records, and
    where the trained model's sown values are)."""
    trained_model(modules)  # a tree of another kind is refused there
    return [] if isinstance(modules, Decoder) else ["model"]


def param_count(model: nnx.Module) -> int:
    return sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
