"""Hugging Face checkpoints (config.json + safetensors) <-> sharded core models.

    model, cfg = load_hf("path/to/hf_dir", dtype="bfloat16", mesh=mesh)
    save_hf(model, cfg, "out_dir", tokenizer_dir="path/to/tokenizer")

The saved directory loads in `transformers` and vLLM. No `trust_remote_code`:
only the families in `core.hf.config.ARCHITECTURES` are accepted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from core.config import ModelConfig
from core.distributed import is_primary, to_host
from core.errors import CheckpointMismatch, MissingPath
from core.hf.config import hf_config_from_model, model_section_from_hf
from core.hf.layout import param_map
from core.models.build import abstract_model, model_from_arrays
from core.models.decoder import Decoder

_NP_DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16}
# Tensors some checkpoints carry that the model does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TOKENIZER_SKIP = {"config.json", "generation_config.json", "model.safetensors.index.json"}


def load_hf(
    path: str | Path,
    *,
    dtype: str = "float32",
    mesh: Mesh | None = None,
    **model_overrides: Any,
) -> tuple[Decoder, ModelConfig]:
    """Load a Hugging Face directory into a core model sharded on `mesh` (default: one device).

    `dtype` is the parameter dtype (and the compute dtype unless `model_overrides`
    sets `dtype`); other overrides are `ModelConfig` fields such as `scan_layers`.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise MissingPath(f"{config_file} not found: not a Hugging Face model directory")
    section = model_section_from_hf(json.loads(config_file.read_text()), source=str(config_file))
    section.update(param_dtype=dtype, dtype=dtype)
    section.update(model_overrides)
    cfg = ModelConfig(**section)

    with _SafetensorsDir(path) as tensors:
        arrays = _core_arrays(cfg, tensors, str(path))
    return model_from_arrays(cfg, arrays, mesh), cfg


def save_hf(
    model: nnx.Module,
    model_config: ModelConfig,
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write config.json, safetensors (sharded above `max_shard_bytes`) and the tokenizer files. In a process group
    every process gathers each tensor with the others and the first one writes (`core.distributed`). A model with
    LoRA adapters (or a quantized base) is written merged: `core.models.adapters.merged_model`."""
    from core.models.adapters import merged_model

    if model_config.lora is not None:
        model = merged_model(model)  # type: ignore[arg-type]
        model_config = model.cfg
    path = Path(path)
    dtype = dtype or model_config.param_dtype
    np_dtype = _NP_DTYPES[dtype]
    if not is_primary():
        for _ in hf_tensors(model, model_config):  # the gathers are collectives: take part, keep nothing
            pass
        return path
    path.mkdir(parents=True, exist_ok=True)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in hf_tensors(model, model_config):
        value = np.ascontiguousarray(value.astype(np_dtype))
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes

    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            total += sum(v.nbytes for v in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    extra = {}
    if tokenizer_dir is not None:
        extra = _copy_tokenizer(Path(tokenizer_dir), path)
    hf_cfg = hf_config_from_model(model_config, torch_dtype=dtype, **extra)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    gen = {k: v for k, v in extra.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


def hf_tensors(params: nnx.Module | nnx.State, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, contiguous host array in HF layout) for every tensor, in HF order.

    Gathered one tensor at a time (one layer of a stacked parameter), so host
    memory stays bounded by the largest tensor; export and weight sync both use it.
    """
    state = nnx.state(params, nnx.Param) if isinstance(params, nnx.Module) else params
    flat = dict(nnx.to_flat_state(state))
    for m in param_map(cfg):
        value = flat[m.core_path].get_value()
        host = to_host(value[m.index] if m.index else value)  # a collective in a process group
        yield m.hf_name, np.ascontiguousarray(m.layer_to_hf(host))


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every Hugging Face tensor of a model with this config."""
    flat = dict(nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)))
    return {m.hf_name: m.hf_shape(tuple(flat[m.core_path].shape)) for m in param_map(cfg)}


# ----------------------------------------------------------------- internals


class _SafetensorsDir:
    """Lazy access to every tensor of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise MissingPath(f"no *.safetensors files in {path}")
        self._handles = [safe_open(str(path / f), framework="numpy") for f in files]
        self.where = {k: h for h in self._handles for k in h.keys()}  # noqa: SIM118 - safe_open is not iterable

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handles.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self.where[name].get_tensor(name)


def _core_arrays(cfg: ModelConfig, tensors: _SafetensorsDir, source: str) -> dict[tuple, np.ndarray]:
    """Host arrays keyed by core path, after checking names and shapes against the config."""
    flat = dict(nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)))
    mappings = param_map(cfg)
    _check_tensors(cfg, tensors, source)

    np_dtype = _NP_DTYPES[cfg.param_dtype]
    arrays: dict[tuple, np.ndarray] = {}
    for m in mappings:
        shape = tuple(flat[m.core_path].shape)
        value = m.from_hf(tensors.get(m.hf_name), shape[len(m.index) :])
        if not m.index:
            arrays[m.core_path] = value.astype(np_dtype)
        else:
            if m.core_path not in arrays:
                arrays[m.core_path] = np.empty(shape, np_dtype)
            arrays[m.core_path][m.index] = value
    return arrays


def _check_tensors(cfg: ModelConfig, tensors: _SafetensorsDir, source: str) -> None:
    expected = hf_shapes(cfg)
    found = set(tensors.where)
    missing = sorted(set(expected) - found)
    unexpected = sorted(
        n
        for n in found - set(expected)
        if not n.endswith(_IGNORED_SUFFIXES) and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    wrong = []
    for name in sorted(set(expected) & found):
        want, got = expected[name], tensors.shape(name)
        if got != want:
            wrong.append(f"{name}: expected {want}, got {got}")
    if missing or unexpected or wrong:
        lines = [f"checkpoint {source} does not match its config ({cfg.family}, {cfg.num_layers} layers):"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        if wrong:
            lines.append(f"  wrong shape ({len(wrong)}): " + "; ".join(wrong))
        raise CheckpointMismatch("\n".join(lines))


def _copy_tokenizer(src: Path, dst: Path) -> dict[str, Any]:
    """Copy tokenizer files; return the special token ids to record in config.json."""
    if not src.is_dir():
        raise MissingPath(f"tokenizer_dir {src} is not a directory")
    for f in src.iterdir():
        if f.is_file() and f.name not in _TOKENIZER_SKIP and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    from core.tokenizer import open_tokenizer

    tok = open_tokenizer(src)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}
