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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from core.config import Config, resolve_mesh_shape
from core.errors import MissingPath, UserError

CONFIG_DIR = Path(__file__).parent / "configs"
PRESET_DIR = CONFIG_DIR / "models"


class ConfigError(UserError, ValueError):
    """A config that cannot be loaded; the message names the file (and line) or the dotted key."""


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    num_devices: int | None = None,
) -> Config:
    """Read, merge, resolve and validate a config; resolve its reward functions and check that the paths it
    names exist. `num_devices` also checks the mesh product. Every failure is a `ConfigError` (or a
    `MissingPath`) naming the file, line or dotted key."""
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
    check_reward_functions(cfg, source)
    check_paths(cfg, source)
    return cfg


def check_reward_functions(cfg: Config, source: str = "<config>") -> None:
    """Import every configured reward function once, so that a typo fails at load, not after a rollout.
    (Only here: validating a config read back from a run directory never imports user code.)"""
    from rewards.registry import UnknownReward, resolve

    for i, fn in enumerate(cfg.reward.functions):
        try:
            resolve(fn.fn)
        except UnknownReward as err:
            raise ConfigError(f"{source}: reward.functions[{i}].fn: {err}") from None


def check_paths(cfg: Config, source: str = "<config>") -> None:
    """Every local path the config names must exist (checked at load, before any work starts)."""
    paths = {
        "checkpoint.init_from": cfg.checkpoint.init_from,
        "data.tokenizer_dir": cfg.data.tokenizer_dir,
    }
    if cfg.data.source is not None and not cfg.data.source.startswith("reasoning_gym:"):
        paths["data.source"] = cfg.data.source
    for key, value in paths.items():
        if value is not None and not Path(value).exists():
            raise MissingPath(f"{source}: {key}: {value} does not exist")


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
    return read_yaml(file)


def hf_config_dict(path: str | Path) -> dict[str, Any]:
    """The model section equivalent to a Hugging Face `config.json` (file or directory)."""
    from core.hf_config import model_section_from_hf  # local: keeps this module light

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.exists():
        raise ConfigError(f"Hugging Face config not found: {file}")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file}:{err.lineno}: not valid JSON: {err.msg}") from None
    return model_section_from_hf(hf, source=str(file))


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
        raise ConfigError(f"base_config cycle: {' -> '.join(map(str, (*_seen, path)))}")
    data = read_yaml(path)
    base = data.pop("base_config", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base_config must be a file name, got {base!r}")
    base_path = Path(base)
    if not base_path.is_absolute() and (path.parent / base_path).exists():
        base_path = path.parent / base_path
    return _deep_merge(_read_tree(base_path, (*_seen, path)), data)


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key repeated in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"{self.name}:{key_node.start_mark.line + 1}: duplicate key {key!r} (first at line {seen[key] + 1})"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict[str, Any]:
    """One config file as a mapping; syntax errors, an empty file, a duplicate key or a top level that is
    not a mapping are `ConfigError`s naming the file (and line)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = err.problem or ""
        if err.context:  # where the construct that went wrong began, e.g. an unclosed bracket
            line = f" at line {err.context_mark.line + 1}" if err.context_mark else ""
            what += f" ({err.context}{line})"
        raise ConfigError(f"{where}: YAML syntax error: {what}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML error: {err}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(
            f"{path}: the file is empty (a config is a YAML mapping of sections, e.g. `train: {{steps: 10}}`)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got a YAML {type(data).__name__}")
    return data


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
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
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
            if not close:  # a key that moved into a sub-section (rl.num_generations -> rl.batch.num_generations)
                section = ".".join(str(p) for p in loc[:-1])
                inner = {f"{sub}.{k}": k for sub in valid for k in _fields_at([*loc[:-1], sub])}
                leaf = difflib.get_close_matches(str(loc[-1]), list(inner.values()), n=3, cutoff=0.8)
                close = [f"{section}.{dotted}" for dotted, k in inner.items() if k in leaf]
            hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(valid)}"
            lines.append(f"  unknown key '{dotted}': {hint}")
        elif e["type"] == "value_error":  # a cross-field check: its message names the keys and values
            lines.append(f"  {dotted + ': ' if dotted else ''}{e['msg'].removeprefix('Value error, ')}")
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
