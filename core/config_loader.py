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
from typing import Any, TypeVar, overload

import yaml
from pydantic import BaseModel, ValidationError

from core.config import Config, resolve_mesh_shape
from core.errors import UserError

CONFIG_DIR = Path(__file__).parent / "configs"
PRESET_DIR = CONFIG_DIR / "models"


class ConfigError(UserError, ValueError):
    """A config that cannot be loaded; the message names the file (and line) or the dotted key."""


C = TypeVar("C", bound=Config)


@overload
def load_config(
    path: str | Path | None = None, overrides: Iterable[str] = (), *, num_devices: int | None = None
) -> Config: ...


@overload
def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    num_devices: int | None = None,
    schema: type[C],
) -> C: ...


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    num_devices: int | None = None,
    schema: type[Config] = Config,
) -> Config:
    """Read, merge, resolve and validate a config against `schema` (`core.config.Config` for pretraining,
    `posttrain.config.PostTrainConfig` for the post-training methods), then run its load-time checks
    (`check_at_load`: paths exist, reward functions resolve). `num_devices` also checks the mesh product. Every
    failure is a `ConfigError` (or a `MissingPath`) naming the file, line or dotted key."""
    raw = _read_tree(Path(path)) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    _resolve_model_section(raw)
    source = str(path) if path is not None else "<defaults>"
    try:
        cfg = schema.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err, source, schema)) from None
    if num_devices is not None:
        try:
            resolve_mesh_shape(cfg.mesh, num_devices)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None
    cfg.check_at_load(source)
    return cfg


def save_config(cfg: Config, run_dir: str | Path) -> Path:
    """Write the resolved config to `run_dir/config.yaml` (what actually ran; by the first process of a group)."""
    from core.distributed import is_primary

    out = Path(run_dir) / "config.yaml"
    if not is_primary():
        return out
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
    from core.hf.config import model_section_from_hf  # local: keeps this module light

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


def _explain(err: ValidationError, source: str, schema: type[BaseModel]) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        dotted = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            loc = [str(p) for p in e["loc"] if not isinstance(p, int)]
            close = suggestions(".".join(loc), schema)
            hint = (
                f"did you mean {', '.join(close)}?"
                if close
                else f"valid keys: {', '.join(_fields_at(loc[:-1], schema))}"
            )
            lines.append(f"  unknown key '{dotted}': {hint}")
        elif e["type"] == "value_error":  # a cross-field check: its message names the keys and values
            lines.append(f"  {dotted + ': ' if dotted else ''}{e['msg'].removeprefix('Value error, ')}")
        else:
            got = e.get("input")
            shown = repr(got) if not isinstance(got, dict) else "a mapping"
            lines.append(f"  {dotted or '<root>'}: {e['msg']} (got {shown})")
    return "\n".join(lines)


def dotted_keys(schema: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of a config schema as a full dotted path: sections and the fields inside them."""
    out = []
    for name, field in schema.model_fields.items():
        out.append(prefix + name)
        sub = _model_in(field.annotation)
        if sub is not None:
            out += dotted_keys(sub, f"{prefix}{name}.")
    return out


def suggestions(key: str, schema: type[BaseModel]) -> list[str]:
    """Full dotted keys that exist and look like the unknown dotted `key`: the same last name elsewhere
    (`rl.num_generations` -> `rl.batch.num_generations`), a near spelling in the same section
    (`model.hiden_size`), the same words joined otherwise (`run_dir`, `run.dir` -> `run.run_dir`)."""
    keys = dotted_keys(schema)
    parent, _, leaf = key.rpartition(".")

    def squash(k: str) -> str:
        return k.replace(".", "").replace("_", "").lower()

    found = [k for k in keys if k.rpartition(".")[2] == leaf and k != key]
    section = [k for k in keys if k.rpartition(".")[0] == parent]
    found += [
        f"{parent}.{k}" if parent else k
        for k in difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in section], n=3, cutoff=0.75)
    ]
    found += [k for k in keys if squash(k) == squash(key) or squash(k.rpartition(".")[2]) == squash(key)]
    if not found:
        found = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    return list(dict.fromkeys(found))[:3]


def _fields_at(loc: list[Any], schema: type[BaseModel]) -> list[str]:
    """Valid field names of the section at a dotted location inside `schema`."""
    cls: type[BaseModel] = schema
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


@overload
def config_from_argv(
    argv: list[str], default: str | Path | None = None, *, num_devices: int | None = None
) -> Config: ...


@overload
def config_from_argv(
    argv: list[str], default: str | Path | None = None, *, num_devices: int | None = None, schema: type[C]
) -> C: ...


def config_from_argv(
    argv: list[str],
    default: str | Path | None = None,
    *,
    num_devices: int | None = None,
    schema: type[Config] = Config,
) -> Config:
    """`[CONFIG.yml] [key=value ...]` as recipes take them; the file defaults to `default`."""
    path: str | Path | None = default
    if argv and "=" not in argv[0]:
        path, argv = argv[0], argv[1:]
    return load_config(path, argv, num_devices=num_devices, schema=schema)
