"""A model with LoRA adapters, built from its base and turned back into a plain model.

    model = add_adapters(base, cfg.model.lora, mesh, seed=0)   # the base's weights (quantized: QLoRA), new adapters
    plain = merged_model(model)                                   # a Decoder without adapters: W + (alpha / r) A B
    reference = adapters_off(model)                               # the same weights with every adapter at zero

`add_adapters` is how every LoRA model is made (a random init too: `core.models.create_model`), so that the
adapters' initial values come from one place (`core.models.lora.lora_init`, keyed by the run seed and the
parameter's path). `merged_model` is what a Hugging Face export and a merged-weights sync read: a model of the
base's config, each adapted kernel replaced by its dequantized base plus its adapter's update. `adapters_off` is
the base as the adapted model sees it (TRL's reference for a PEFT model: the policy with its adapters disabled);
it shares the base's arrays, so it costs no second copy.
"""

from __future__ import annotations

import math
import zlib
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from core.config import LoraConfig
from core.mesh import named_sharding
from core.models.decoder import Decoder
from core.models.layers import Dense
from core.models.lora import lora_init
from core.models.quant import dequantize_kernel, quantize_kernel


def _dense_modules(model: nnx.Module) -> dict[tuple, Dense]:
    return {tuple(path): m for path, m in nnx.iter_graph(model) if isinstance(m, Dense)}


def _layered(dense: Dense, value: jax.Array) -> bool:
    """Whether `value` (a kernel of `dense`) carries a leading `layers` axis (scanned layers)."""
    return value.ndim == len(dense.shape) + 1


def add_adapters(model: Decoder, lora: LoraConfig, mesh: Mesh, seed: int) -> Decoder:
    """`model` (a plain Decoder) with LoRA adapters on `lora.target_modules`, A initialised from `seed`, B at zero;
    with `lora.quantize_base` its projections' kernels stored quantized. Its other parameters are its own arrays."""
    from core.models.build import abstract_model

    if model.cfg.lora is not None:
        raise ValueError("add_adapters: the model already has LoRA adapters")
    cfg = model.cfg.model_copy(update={"lora": lora})
    shapes = abstract_model(cfg)
    adapted = _dense_modules(shapes)  # the projections as the adapted model has them (what is quantized, A's shape)
    graphdef, abstract = nnx.split(shapes)
    target = dict(nnx.to_flat_state(abstract))
    source = dict(nnx.to_flat_state(nnx.state(model)))
    base_dense = _dense_modules(model)
    key = jax.random.key(seed)
    for path, var in target.items():
        sharding = named_sharding(mesh, var.get_metadata("logical_axes"), var.shape)
        owner, leaf = path[:-1], path[-1]
        if path in source:
            value = source[path].get_value()
        elif leaf in ("kernel_q", "kernel_scale"):
            kernel = base_dense[owner].kernel[...]  # type: ignore[index]
            d = adapted[owner]
            stored = _quantize(kernel, d.in_axes, lora.quantize_base, lora.quant_block_size, _layered(d, kernel))
            value = stored["q" if leaf == "kernel_q" else "scale"]
        elif path[-2:] == ("lora", "a"):
            d = adapted[path[:-2]]
            fan_in = math.prod(d.shape[: d.in_axes])
            path_key = jax.random.fold_in(key, zlib.crc32(".".join(map(str, path)).encode()))
            value = lora_init(path_key, var.shape, fan_in, lora, var.dtype)
        elif path[-2:] == ("lora", "b"):
            value = jnp.zeros(var.shape, var.dtype)
        else:
            raise ValueError(f"add_adapters: no value for {'.'.join(map(str, path))}")
        target[path] = var.replace(jax.device_put(value, sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(target))


@partial(jax.jit, static_argnames=("in_axes", "kind", "block", "layered"))
def _quantize(kernel, in_axes: int, kind: str, block: int, layered: bool) -> dict:
    return quantize_kernel(kernel, in_axes, kind, block, layered)  # type: ignore[arg-type]


def _full_kernel(dense: Dense) -> jax.Array:
    """The dense's base kernel as float32, stacked when its layers are (dequantized when stored quantized)."""
    if dense.kernel is not None:
        return dense.kernel[...].astype(jnp.float32)
    assert dense.kernel_q is not None and dense.kernel_scale is not None
    q = dense.kernel_q[...]
    layered = q.ndim == 3
    shape = (q.shape[0], *dense.shape) if layered else dense.shape
    stored = {"q": q, "scale": dense.kernel_scale[...]}
    return _dequantize(stored, shape, dense.in_axes, dense.quant, layered)


@partial(jax.jit, static_argnames=("shape", "in_axes", "kind", "layered"))
def _dequantize(stored, shape, in_axes: int, kind: str, layered: bool):
    return dequantize_kernel(stored, shape, in_axes, kind, layered)  # type: ignore[arg-type]


def merged_model(model: Decoder) -> Decoder:
    """A plain Decoder (no adapters, nothing quantized) computing what `model` computes: every adapted kernel
    replaced by its (dequantized) base plus `scale * A B`, in the base's parameter dtype; `model` itself when it
    has no adapters."""
    if model.cfg.lora is None:
        return model
    from core.models.build import abstract_model

    cfg = model.cfg.model_copy(update={"lora": None})
    graphdef, abstract = nnx.split(abstract_model(cfg))
    target = dict(nnx.to_flat_state(abstract))
    source = dict(nnx.to_flat_state(nnx.state(model)))
    dense = _dense_modules(model)
    mesh = next(iter(source.values())).get_value().sharding.mesh
    for path, var in target.items():
        owner = path[:-1]
        if path[-1] == "kernel" and owner in dense and (dense[owner].lora is not None or dense[owner].quant != "none"):
            d = dense[owner]
            value = _full_kernel(d)
            if d.lora is not None:
                value = value + d.lora.delta()
            sharding = named_sharding(mesh, var.get_metadata("logical_axes"), var.shape)
            value = jax.device_put(value.astype(var.dtype), sharding)
        else:
            value = source[path].get_value()
        target[path] = var.replace(value)
    return nnx.merge(graphdef, nnx.from_flat_state(target))


def adapters_off(model: Decoder) -> Decoder:
    """`model` with every adapter's A and B at zero: the base it adapts (its arrays shared, not copied)."""
    if model.cfg.lora is None:
        return model
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)  # type: ignore[misc]
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, adapters), rest)
