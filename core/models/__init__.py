"""Flax NNX decoder family (Llama, Qwen2/2.5, Qwen3, Mistral) with logical axis names on every parameter."""

from core.models.build import (
    ModuleTree,
    abstract_model,
    abstract_sharded_state,
    create_model,
    logical_axes,
    model_from_arrays,
    param_count,
    shard_model,
    state_mismatches,
    state_shardings,
    trained_model,
    trained_model_path,
)
from core.models.decoder import Decoder

__all__ = [
    "Decoder",
    "ModuleTree",
    "abstract_model",
    "abstract_sharded_state",
    "create_model",
    "logical_axes",
    "model_from_arrays",
    "param_count",
    "shard_model",
    "state_mismatches",
    "state_shardings",
    "trained_model",
    "trained_model_path",
]
