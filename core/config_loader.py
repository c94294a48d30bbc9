"""Load a `Config` from YAML files, model presets and dotted command-line overrides.

Order of precedence (later wins): `base_config` chain -> the file itself ->
`key=value` overrides. The model section may name a `preset` (a YAML file in
`core/configs/models/`) or an `hf_config` (a Hugging Face `config.json` or the
directory holding it); its explicit keys override the preset's.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from core.config import Config, resolve_mesh_shape

CONFIG_DIR = Path(__file__).parent / "configs"
PRESET_DIR = CONFIG_DIR / "models"


class ConfigError(ValueError):
    """A config that cannot be loaded; the message names the file and the dotted key."""


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    num_devices: int | None = None,
) -> Config:
    """Read, merge, resolve and validate a config. `num_devices` also checks the mesh product."""
    raw = _read_tree(Path(path)) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    _resolve_model_section(raw)
    source = str(path) if path is not None else "<defaults>"
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, source)) from None
    if num_devices is not None:
        try:
            resolve_mesh_shape(cfg.mesh, num_devices)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None
    return cfg


def save_config(cfg: Config, run_dir: str | Path) -> Path:
    """Write the resolved config to `run_dir/config.yaml` (what actually ran)."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return out


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yml"))


def preset_dict(name: str) -> dict[str, Any]:
    """The model section of a named preset."""
    file = PRESET_DIR / f"{name}.yml"
    if not file.exists():
        raise ConfigError(f"unknown model preset {name!r}; available: {', '.join(list_presets())}")
    return yaml.safe_load(file.read_text()) or {}


def hf_config_dict(path: str | Path) -> dict[str, Any]:
    """The model section equivalent to a Hugging Face `config.json` (file or directory)."""
    from core.hf_config import model_section_from_hf  # local: keeps this module light

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.exists():
        raise ConfigError(f"Hugging Face config not found: {file}")
    return model_section_from_hf(json.loads(file.read_text()), source=str(file))


# ----------------------------------------------------------------- internals


def _read_tree(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML file merged over its `base_config` chain (relative paths, or names in core/configs)."""
    if not path.exists():
        candidate = CONFIG_DIR / path
        if not candidate.exists():
            raise ConfigError(f"config file not found: {path}")
        path = candidate
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"base_config cycle: {' -> '.join(map(str, _seen + (path,)))}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base_config", None)
    if base is None:
        return data
    base_path = Path(base)
    if not base_path.is_absolute() and (path.parent / base_path).exists():
        base_path = path.parent / base_path
    return _deep_merge(_read_tree(base_path, _seen + (path,)), data)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply `a.b.c=value`; the value is parsed as YAML (ints, floats, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key component")
    value = yaml.safe_load(text) if text.strip() else ""
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _resolve_model_section(raw: dict[str, Any]) -> None:
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    hf = model.pop("hf_config", None)
    base: dict[str, Any] = {}
    if model.get("preset"):
        base = preset_dict(model["preset"])
    if hf:
        base = _deep_merge(base, hf_config_dict(hf))
    raw["model"] = _deep_merge(base, model)


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = [p for p in e["loc"] if not isinstance(p, int)]
        dotted = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            valid = sorted(_fields_at(loc[:-1]))
            close = difflib.get_close_matches(str(loc[-1]), valid, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(valid)}"
            lines.append(f"  unknown key '{dotted}': {hint}")
        else:
            got = e.get("input")
            shown = repr(got) if not isinstance(got, dict) else "a mapping"
            lines.append(f"  {dotted or '<root>'}: {e['msg']} (got {shown})")
    return "\n".join(lines)


def _fields_at(loc: list[Any]) -> list[str]:
    """Valid field names of the section at a dotted location inside `Config`."""
    cls: type[BaseModel] = Config
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return []
        sub = _model_in(field.annotation)
        if sub is None:
            return []
        cls = sub
    return list(cls.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def config_from_argv(argv: list[str], default: str | Path | None = None, *, num_devices: int | None = None) -> Config:
    """`[CONFIG.yml] [key=value ...]` as recipes take them; the file defaults to `default`."""
    path: str | Path | None = default
    if argv and "=" not in argv[0]:
        path, argv = argv[0], argv[1:]
    return load_config(path, argv, num_devices=num_devices)
