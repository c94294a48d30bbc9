"""Reward functions by name: built-ins, `package.module:function`, `path/to/file.py:function`, entry points.

    fn = resolve("math_verify")                      # a built-in (the table below)
    fn = resolve("my_pkg.rewards:brevity")           # importable module
    fn = resolve("rewards/mine.py:brevity")          # a file (relative to the working directory)
    fn = resolve("brevity")                          # an entry point in the `temper.rewards` group

A reward function is `fn(prompts, completions, **columns) -> list[float]`:
one float per completion; `columns` are the dataset fields of each example
(lists aligned with `completions`), `completion_ids` (token ids) and the
function's `kwargs` from the config.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

from core.errors import UserError

RewardFunction = Callable[..., list]

ENTRY_POINT_GROUP = "temper.rewards"

# name -> "module:function"; the modules are imported only when the reward is used.
BUILTINS: dict[str, str] = {
    "math_verify": "rewards.mathverify:math_verify",
    "gsm8k": "rewards.gsm8k:gsm8k",
    "format": "rewards.shaping:format",
    "length_penalty": "rewards.shaping:length_penalty",
    "overlong": "rewards.shaping:overlong",
    "reasoning_gym": "rewards.rgym:reasoning_gym",
}


class UnknownReward(UserError, ValueError):
    """A reward name that is not a built-in, an importable function, a file or an entry point."""


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _unknown(spec: str, why: str) -> UnknownReward:
    plugins = sorted(_entry_points())
    close = difflib.get_close_matches(spec, [*BUILTINS, *plugins], n=1)
    return UnknownReward(
        f"unknown reward function {spec!r}: {why}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f". Built-ins: {', '.join(BUILTINS)}"
        + (f"; entry points ({ENTRY_POINT_GROUP}): {', '.join(plugins)}" if plugins else "")
        + ". Or name one as package.module:function or path/to/file.py:function."
    )


def canonical(spec: str) -> str:
    """The spec as `module:function` or `/absolute/file.py:function`, so a worker process finds the same code."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec and spec in _entry_points():
        return _entry_points()[spec].value
    if ":" in spec:
        target, attr = spec.rsplit(":", 1)
        if target.endswith(".py"):
            return f"{Path(target).resolve()}:{attr}"
    return spec


@functools.cache
def resolve(spec: str) -> RewardFunction:
    """The callable a spec names; raises UnknownReward saying what was not found."""
    if spec in BUILTINS:
        return resolve(BUILTINS[spec])
    if ":" not in spec:
        ep = _entry_points().get(spec)
        if ep is None:
            raise _unknown(spec, "no built-in or entry point has that name")
        return _callable(spec, ep.load())
    target, attr = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise _unknown(spec, f"file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"temper_reward_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise _unknown(spec, f"file {path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UnknownReward(f"reward function {spec!r}: loading {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise _unknown(spec, f"cannot import {target} ({e})") from e
    if not hasattr(module, attr):
        raise _unknown(spec, f"{target} has no attribute {attr!r}")
    return _callable(spec, getattr(module, attr))


def _callable(spec: str, obj) -> RewardFunction:
    if not callable(obj):
        raise _unknown(spec, f"it names a {type(obj).__name__}, not a function")
    return obj
