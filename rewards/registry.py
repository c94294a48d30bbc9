"""Reward functions by name: built-ins, `package.module:function`, `path/to/file.py:function`, entry points.

    fn = resolve("math_verify")                      # a built-in (the table below)
    fn = resolve("my_pkg.rewards:brevity")           # importable module
    fn = resolve("rewards/mine.py:brevity")          # a file (relative to the working directory)
    fn = resolve("brevity")                          # an entry point in the `temper.rewards` group

A reward function is `fn(prompts, completions, **columns) -> list[float]`:
one float per completion; `columns` are the dataset fields of each example
(lists aligned with `completions`), `completion_ids` (token ids) and the
function's `kwargs` from the config.

The other plugins a run loads by name resolve the same way, each kind with its own built-ins and entry-point
group (`KINDS`): environments of multi-turn rollouts (`rollout.environment`, group `temper.environments`) and
the tools they offer (group `temper.tools`), and agent programs written against an OpenAI client
(`rollout.agent_program`, group `temper.agents`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
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
    "reward_model": "rewards.model:reward_model",
    "llm_judge": "rewards.judge:Judge",
}
# A built-in's check of its kwargs, run at config load (raises ValueError saying what is wrong).
BUILTIN_CHECKS: dict[str, str] = {"reward_model": "rewards.model:check", "llm_judge": "rewards.judge:check"}
# Built-ins that serve their own model from the run's process (a class built once with the kwargs, with `score`
# and `close`), not functions run in the reward workers.
SERVED: frozenset[str] = frozenset({"rewards.judge:Judge"})


@dataclass(frozen=True)
class Kind:
    """A kind of plugin: what it is called in messages, its built-ins and its entry-point group."""

    noun: str
    builtins: dict[str, str]
    group: str


KINDS: dict[str, Kind] = {
    "reward": Kind("reward function", BUILTINS, ENTRY_POINT_GROUP),
    "environment": Kind(
        "environment",
        {"tools": "rollout.tool_env:ToolEnvironment", "coding": "rollout.coding_env:CodingEnvironment"},
        "temper.environments",
    ),
    "tool": Kind("tool", {"calculator": "rollout.calculator:calculator"}, "temper.tools"),
    "agent": Kind("agent program", {}, "temper.agents"),
}


class UnknownReward(UserError, ValueError):
    """A plugin name (a reward function, an environment, a tool) that is not a built-in, an importable object, a
    file or an entry point."""


def _entry_points(group: str = ENTRY_POINT_GROUP) -> dict:
    return {ep.name: ep for ep in entry_points(group=group)}


def _unknown(spec: str, why: str, kind: str = "reward") -> UnknownReward:
    k = KINDS[kind]
    plugins = sorted(_entry_points(k.group))
    close = difflib.get_close_matches(spec, [*k.builtins, *plugins], n=1)
    return UnknownReward(
        f"unknown {k.noun} {spec!r}: {why}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f". Built-ins: {', '.join(k.builtins)}"
        + (f"; entry points ({k.group}): {', '.join(plugins)}" if plugins else "")
        + ". Or name one as package.module:name or path/to/file.py:name."
    )


def canonical(spec: str, kind: str = "reward") -> str:
    """The spec as `module:name` or `/absolute/file.py:name`, so a worker process finds the same code."""
    k = KINDS[kind]
    if spec in k.builtins:
        return k.builtins[spec]
    if ":" not in spec and spec in _entry_points(k.group):
        return _entry_points(k.group)[spec].value
    if ":" in spec:
        target, attr = spec.rsplit(":", 1)
        if target.endswith(".py"):
            return f"{Path(target).resolve()}:{attr}"
    return spec


@functools.cache
def resolve(spec: str, kind: str = "reward") -> RewardFunction:
    """The callable a spec names (a function; an environment's class); raises UnknownReward saying what was not
    found."""
    k = KINDS[kind]
    if spec in k.builtins:
        return resolve(k.builtins[spec], kind)
    if ":" not in spec:
        ep = _entry_points(k.group).get(spec)
        if ep is None:
            raise _unknown(spec, "no built-in or entry point has that name", kind)
        return _callable(spec, ep.load(), kind)
    target, attr = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise _unknown(spec, f"file {path} does not exist", kind)
        module_spec = importlib.util.spec_from_file_location(f"temper_{kind}_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise _unknown(spec, f"file {path} cannot be imported as a Python module", kind)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UnknownReward(f"{k.noun} {spec!r}: loading {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise _unknown(spec, f"cannot import {target} ({e})", kind) from e
    if not hasattr(module, attr):
        raise _unknown(spec, f"{target} has no attribute {attr!r}", kind)
    return _callable(spec, getattr(module, attr), kind)


def _callable(spec: str, obj, kind: str = "reward") -> RewardFunction:
    if not callable(obj):
        raise _unknown(spec, f"it names a {type(obj).__name__}, not a function or class", kind)
    return obj
