"""LoRA adapters in PEFT's format: the directory `peft`, transformers and vLLM load.

    save_adapter(model, "run/hf/adapter", base="Qwen/Qwen2.5-0.5B")   # adapter_config.json + adapter_model.safetensors
    adapter = read_adapter("run/hf/adapter")                           # its LoraConfig, base and tensors
    model = load_adapter(model, adapter)                               # those values in a model with adapters

Keys are PEFT's (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`), `lora_A` `[r, in]` and
`lora_B` `[out, r]` in Hugging Face's layout (`core.models.lora`: A `[*in, r]` and B `[r, *out]` flattened and
transposed), float32. The config carries `r`, `lora_alpha`, `lora_dropout`, `target_modules`, `use_rslora` and
the base model's name; a directory whose config asks for what Temper's adapters are not (bias terms, other
modules, per-layer ranks, DoRA) is refused, naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from core.config import LORA_TARGETS, LoraConfig
from core.errors import CheckpointMismatch, MissingPath
from core.hf.layout import LAYER_TABLE
from core.models.decoder import Decoder

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter directory's contents."""

    lora: LoraConfig
    base: str | None  # base_model_name_or_path
    tensors: dict[str, np.ndarray]  # PEFT key -> value


def _module_prefixes(num_layers: int, targets: Sequence[str]) -> list[tuple[int, str, tuple[str, ...]]]:
    """(layer, PEFT module name, core path of the projection inside a layer) of every adapted projection."""
    out = []
    for i in range(num_layers):
        for core_path, hf_name, _, _ in LAYER_TABLE:
            if core_path[-1] != "kernel" or core_path[-2] not in targets:
                continue
            out.append((i, f"{PREFIX}model.layers.{i}.{hf_name.removesuffix('.weight')}", core_path[:-1]))
    return out


def _adapter_arrays(model: Decoder, core_path: tuple[str, ...], layer: int) -> tuple[nnx.Variable, nnx.Variable, bool]:
    """(A, B, stacked) of the projection at `core_path` of decoder layer `layer`."""
    layers = model.layers
    dense = layers if model.cfg.scan_layers else layers[layer]
    for name in core_path:
        dense = getattr(dense, name)
    if dense.lora is None:
        raise ValueError(f"layer {layer} {'.'.join(core_path)} has no LoRA adapter")
    return dense.lora.a, dense.lora.b, model.cfg.scan_layers


def adapter_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """`model`'s adapters as PEFT's tensors (float32, Hugging Face layout), gathered to the host (in a process
    group every process takes part and gets them)."""
    from core.distributed import to_host

    lora = model.cfg.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters")
    tensors: dict[str, np.ndarray] = {}
    r = lora.rank
    gathered: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # a projection's (A, B), stacked layers once
    for layer, name, core_path in _module_prefixes(model.cfg.num_layers, lora.target_modules):
        a, b, stacked = _adapter_arrays(model, core_path, layer)
        key = core_path if stacked else (*core_path, layer)
        if key not in gathered:
            gathered[key] = (to_host(a[...]), to_host(b[...]))
        a_value, b_value = gathered[key]
        if stacked:
            a_value, b_value = a_value[layer], b_value[layer]
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_value.reshape(-1, r).T.astype(np.float32))
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_value.reshape(r, -1).T.astype(np.float32))
    return tensors


def adapter_shapes(cfg) -> dict[str, tuple[int, int]]:
    """PEFT key -> shape of every tensor of the adapters a model of `cfg` (a `ModelConfig` with `lora`) has."""
    import math

    from core.models.build import abstract_model

    lora = cfg.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters")
    model = abstract_model(cfg)
    lead = 1 if cfg.scan_layers else 0
    shapes = {}
    for layer, name, core_path in _module_prefixes(cfg.num_layers, lora.target_modules):
        a, b, _ = _adapter_arrays(model, core_path, layer)
        shapes[f"{name}.lora_A.weight"] = (lora.rank, math.prod(a.shape[lead:-1]))
        shapes[f"{name}.lora_B.weight"] = (math.prod(b.shape[lead + 1 :]), lora.rank)
    return shapes


def adapter_config(lora: LoraConfig, base: str | None) -> dict:
    """PEFT's `adapter_config.json` for adapters of `lora` on `base`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "use_rslora": lora.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True if lora.init == "default" else lora.init,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
    }


def write_adapter(path: str | Path, tensors: dict[str, np.ndarray], config: dict) -> Path:
    """A PEFT adapter directory at `path` (created) from its tensors and config; returns it."""
    from safetensors.numpy import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def save_adapter(model: Decoder, path: str | Path, base: str | None = None) -> Path:
    """`model`'s adapters as a PEFT directory at `path`; returns it. In a process group every process gathers the
    adapters and the first one writes."""
    from core.distributed import is_primary

    tensors = adapter_tensors(model)
    assert model.cfg.lora is not None  # adapter_tensors checked
    if not is_primary():
        return Path(path)
    return write_adapter(path, tensors, adapter_config(model.cfg.lora, base))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def _adapter_config(where: Path) -> dict:
    """The adapter directory's `adapter_config.json`, parsed; an error naming the file otherwise."""
    config_file = where / CONFIG_FILE
    if not config_file.is_file():
        raise MissingPath(f"{where}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointMismatch(f"{config_file}: not valid JSON ({err})") from None


def read_adapter(path: str | Path) -> Adapter:
    """The adapter at `path`; an error naming the file and key for what Temper cannot load."""
    from safetensors.numpy import load_file

    where = Path(path)
    config_file = where / CONFIG_FILE
    config = _adapter_config(where)
    refuse = {
        "peft_type": (config.get("peft_type"), "LORA"),
        "bias": (config.get("bias", "none"), "none"),
        "use_dora": (config.get("use_dora", False), False),
        "fan_in_fan_out": (config.get("fan_in_fan_out", False), False),
        "rank_pattern": (config.get("rank_pattern") or {}, {}),
        "alpha_pattern": (config.get("alpha_pattern") or {}, {}),
        "modules_to_save": (config.get("modules_to_save") or None, None),
        "layers_to_transform": (config.get("layers_to_transform"), None),
    }
    for key, (found, wanted) in refuse.items():
        if found != wanted:
            raise CheckpointMismatch(
                f"{config_file}: {key}={found!r}; Temper's LoRA adapters load only {key}={wanted!r}"
            )
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = list(LORA_TARGETS) if targets == "all-linear" else None
    if not isinstance(targets, list) or any(t not in LORA_TARGETS for t in targets):
        raise CheckpointMismatch(
            f"{config_file}: target_modules={config.get('target_modules')!r}; Temper adapts {list(LORA_TARGETS)}"
        )
    init = config.get("init_lora_weights", True)
    lora = LoraConfig(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        target_modules=tuple(t for t in LORA_TARGETS if t in targets),
        use_rslora=bool(config.get("use_rslora", False)),
        init="gaussian" if init == "gaussian" else "default",
    )
    weights = where / WEIGHTS_FILE
    if not weights.is_file():
        raise MissingPath(f"{where}: no {WEIGHTS_FILE} (Temper reads PEFT adapters saved as safetensors)")
    return Adapter(lora, config.get("base_model_name_or_path"), load_file(str(weights)))


def load_adapter(model: Decoder, adapter: Adapter, where: str = "the adapter") -> Decoder:
    """`model` (with adapters of `adapter.lora`'s rank and targets) with the adapter's values, in place; every
    missing, unexpected or misshapen tensor named."""
    lora = model.cfg.lora
    if lora is None or lora.rank != adapter.lora.rank or lora.target_modules != adapter.lora.target_modules:
        theirs = f"rank {adapter.lora.rank}, targets {list(adapter.lora.target_modules)}"
        ours = "none" if lora is None else f"rank {lora.rank}, targets {list(lora.target_modules)}"
        raise CheckpointMismatch(f"{where} has adapters of {theirs}; the model's are {ours}")
    expected = _module_prefixes(model.cfg.num_layers, lora.target_modules)
    wanted = {f"{name}.lora_{ab}.weight" for _, name, _ in expected for ab in "AB"}
    problems = [f"missing {k}" for k in sorted(wanted - adapter.tensors.keys())]
    problems += [f"unexpected {k}" for k in sorted(adapter.tensors.keys() - wanted)]
    updates: dict[tuple, dict] = {}  # (projection, A or B) -> its variable and new values by layer
    for layer, name, core_path in expected:
        a, b, stacked = _adapter_arrays(model, core_path, layer)
        in_shape = a.shape[1 if stacked else 0 : -1]
        out_shape = b.shape[2 if stacked else 1 :]
        r = lora.rank
        for ab, var, shape in (("A", a, (*in_shape, r)), ("B", b, (r, *out_shape))):
            key = f"{name}.lora_{ab}.weight"
            if key not in adapter.tensors:
                continue
            value = np.asarray(adapter.tensors[key], np.float32)
            hf_shape = (r, int(np.prod(in_shape))) if ab == "A" else (int(np.prod(out_shape)), r)
            if value.shape != hf_shape:
                problems.append(f"{key}: expected {hf_shape}, got {value.shape}")
                continue
            core = value.T.reshape(shape)
            entry = updates.setdefault((core_path, ab), {"var": var, "stacked": stacked, "layers": {}})
            entry["layers"][layer] = core
    if problems:
        raise CheckpointMismatch(f"{where} does not fit the model:\n  " + "\n  ".join(problems[:40]))
    from core.distributed import to_host

    for entry in updates.values():
        var = entry["var"]
        current = var.get_value()
        if entry["stacked"]:
            host = np.array(to_host(current))  # every process gets the whole stack (a collective in a group)
            for layer, value in entry["layers"].items():
                host[layer] = value
            new = host
        else:
            (new,) = entry["layers"].values()
        var.set_value(jax.device_put(np.asarray(new, current.dtype), current.sharding))
    return model


def model_with_adapters(init_from: str, lora: LoraConfig, mesh, seed: int, dtype: str) -> Decoder:
    """A model with the adapters `lora` describes on the base `init_from` names: an HF directory, a Hub id, a Temper
    run (merged first if it has adapters of its own), or a PEFT adapter directory (its base, and its adapters'
    values as the starting point; they must be adapters of `lora`'s shape). The base's shape wins over the run's
    model section."""
    from core.checkpoint_models import load_model_from
    from core.hf.hub import resolve_model
    from core.models.adapters import add_adapters, merged_model

    where = resolve_model(str(init_from))
    adapter = None
    base_path: str | Path = where
    if is_adapter_dir(where):
        adapter = read_adapter(where)
        if adapter.base is None:
            raise CheckpointMismatch(f"{where}: its adapter_config.json names no base_model_name_or_path")
        check_same_adapters(lora, adapter.lora, str(where))
        base_path = adapter.base
    model = add_adapters(merged_model(load_model_from(base_path, mesh, dtype=dtype)), lora, mesh, seed)
    if adapter is not None:
        load_adapter(model, adapter, str(where))
    return model


def check_same_adapters(ours: LoraConfig, theirs: LoraConfig, where: str) -> None:
    """A PEFT adapter the run starts from must be the adapters `model.lora` asks for."""
    keys = ("rank", "alpha", "target_modules", "use_rslora")
    shown = lambda v: list(v) if isinstance(v, tuple) else v
    diffs = [
        f"{k}: adapter {shown(getattr(theirs, k))!r}, model.lora {shown(getattr(ours, k))!r}"
        for k in keys
        if getattr(theirs, k) != getattr(ours, k)
    ]
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint.init_from={where} is a PEFT adapter unlike model.lora:\n  " + "\n  ".join(diffs)
        )


def adapter_base(init_from: str | None) -> str | None:
    """The base model an adapter trained from `checkpoint.init_from` sits on, as its `base_model_name_or_path`:
    `init_from` itself, or, when that is a PEFT adapter directory, the base that adapter names (so the exported
    adapter loads onto the model it was trained on, not onto another adapter)."""
    from core.hf.hub import resolve_model

    if init_from is None:
        return None
    try:
        where = resolve_model(str(init_from))
    except MissingPath:
        return init_from
    if is_adapter_dir(where):  # its config alone (the run read and checked the whole adapter at its start)
        return _adapter_config(Path(where)).get("base_model_name_or_path") or init_from
    return init_from
