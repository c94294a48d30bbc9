"""Tools a model calls in a multi-turn rollout: plain Python functions with type hints and a docstring.

    schema = tool_schema(calculator)                 # the JSON schema chat templates render (`tools=`)
    reply = call_tool(calculator, schema, ToolCall("calculator", '{"expression": "12 * 7"}'), timeout_s=5)
    reply.content, reply.error                       # "84", None

A tool's JSON schema is made by the library that already makes them for chat templates (transformers'
`get_json_schema`, from the signature and the Google-style docstring), so what the model is shown is what its
family's template renders for that function. A call is checked against that schema before the function runs
(a name the model invented, arguments that are not a JSON object, a missing required argument, an unknown one,
a value of the wrong type); the function then runs under a deadline. Whatever goes wrong (a bad call, the tool
raising, overrunning its deadline, returning something that is not text or JSON) becomes an error message the
model reads in the tool's reply, as the peers do, never an exception out of the rollout; `ToolReply.error`
says which, for the metrics.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Tool = Callable[..., Any]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments as the JSON text it produced."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolReply:
    """What a call gave back to the model: the tool's output, or an error message; `error` names the failure
    kind (None: the call succeeded)."""

    content: str
    error: str | None = None  # "unknown_tool" | "bad_arguments" | "raised" | "timeout" | "bad_result"


def tool_schema(fn: Tool) -> dict:
    """The function's JSON schema as chat templates take it (`{"type": "function", "function": {...}}`); a
    function without type hints or a docstring describing its arguments is refused, naming it."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(f"tool {name!r} has no usable schema: {err}") from None


def check_arguments(schema: Mapping, arguments: str) -> dict:
    """The call's arguments as keyword arguments, checked against the tool's schema; ValueError saying what is
    wrong otherwise."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"arguments are not valid JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(args, dict):
        raise ValueError(f"arguments must be a JSON object, not {type(args).__name__}")
    params = schema["function"].get("parameters", {})
    properties: Mapping[str, Mapping] = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        raise ValueError(f"missing required argument(s) {', '.join(missing)}")
    unknown = [k for k in args if k not in properties]
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; it takes {', '.join(properties) or 'none'}")
    for key, value in args.items():
        spec = properties[key]
        kinds = spec.get("type")
        allowed = [kinds] if isinstance(kinds, str) else list(kinds or [])
        types = tuple(t for k in allowed for t in _JSON_TYPES.get(k, ()))
        # JSON has one number type: a bool is not an integer here, and 3.0 is not an integer.
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ValueError(f"argument {key!r} must be {' or '.join(allowed)}, not {json.dumps(value)}")
        if "enum" in spec and value not in spec["enum"]:
            raise ValueError(f"argument {key!r} must be one of {spec['enum']}, not {json.dumps(value)}")
    return args


class _Deadline:
    """Raises TimeoutError in the main thread after `seconds` (a tool stuck in Python code); elsewhere, or with
    no limit, nothing (the worker pool's own deadline still kills a worker stuck in C code)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds if seconds and threading.current_thread() is threading.main_thread() else None

    def __enter__(self):
        if self.seconds:
            self._old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)

    def _fire(self, signum, frame):
        raise TimeoutError


def call_tool(fn: Tool | None, schema: Mapping | None, call: ToolCall, timeout_s: float | None = None) -> ToolReply:
    """Run one call (`fn` None: the model named a tool it was not offered); every failure is the reply's error."""
    if fn is None or schema is None:
        return ToolReply(f"Error: there is no tool named {call.name!r}.", "unknown_tool")
    try:
        args = check_arguments(schema, call.arguments)
    except ValueError as err:
        return ToolReply(f"Error: bad call to {call.name}: {err}.", "bad_arguments")
    try:
        with _Deadline(timeout_s):
            out = fn(**args)
    except TimeoutError:
        return ToolReply(f"Error: {call.name} did not finish within {timeout_s:g} s.", "timeout")
    except Exception as err:
        return ToolReply(f"Error: {call.name} failed: {type(err).__name__}: {err}", "raised")
    if isinstance(out, str):
        return ToolReply(out)
    try:
        return ToolReply(json.dumps(out))
    except (TypeError, ValueError):
        return ToolReply(f"Error: {call.name} returned a {type(out).__name__}, not text or JSON.", "bad_result")


def tool_messages(calls: Sequence[ToolCall], replies: Sequence[ToolReply]) -> list[dict]:
    """The chat messages that carry the replies back to the model, one `tool` message per call, in order."""
    return [{"role": "tool", "name": c.name, "content": r.content} for c, r in zip(calls, replies, strict=True)]
