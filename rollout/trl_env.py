"""Environment classes written for TRL's `GRPOTrainer(environment_factory=...)`, used unchanged
(`rl.agent.environment: my_envs.py:Counter`).

    class Counter:                                     # TRL's shape: no base class, no step()
        def reset(self, **kwargs) -> str | None:       # the row's columns; a string is appended to the prompt
            self.total = 0
        def increment(self, step: int) -> str:         # every public method is a tool (typed, Google docstring)
            \"\"\"Add to the counter.

            Args:
                step: How much to add.
            \"\"\"
            self.total += step
            return str(self.total)
        def get_reward(self) -> float:                 # optional: the episode's reward, read when it ends
            return float(self.total == 10)

One instance per episode, as TRL makes one per rollout. `reset(**row)` gets the row (its `prompt`: the formatted
`rl.prompt_template`) and may return an observation, appended to the prompt's user message as TRL appends it. The
class's public methods (not `reset`, not `get_reward`, not starting with `_`) are the tools the model is offered
(their schemas from their type hints and Google-style docstrings, `rollout.tools.tool_schema`). Each assistant turn's
calls run on the instance in order, checked against the schemas, each under `tool_timeout_s`; their results go back
as `tool` messages, and a failure is an error message the model reads, as for the built-in `tools` environment. A
turn without a call is the answer: the episode ends, with `get_reward()` as its environment reward where the class
has one (the run's reward functions score the answer too, when set). Tools and `get_reward` may be coroutines, as
TRL allows (an LLM judge's reward, a client's call): they run on one event loop per worker, in a thread of its own,
so that a client an instance made on it keeps working from call to call; `reset` is synchronous (TRL's protocol).

Temper's environments keep their state as a value that travels with every call (`rollout.environment`). A TRL
instance is an object (it may hold an open socket, a subprocess, a client), so it stays in the worker that built it:
the episode's state is its key there, and every step of the episode goes to that worker (`EnvStart.pinned`); the
instance is dropped when the episode ends, answered, cut or failed. If that worker is replaced (a step, or a reward
function sharing the pool, hung or killed it) the instance is gone: the next step raises `StateLost`, and the episode
restarts from its row with a fresh instance (`rl.agent.retries`, counted as `agent/retries/lost`). After kill -9 the
episodes in flight restart too: a checkpoint stores finished episodes only, and a resumed run samples the step again.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from rewards.registry import resolve
from rollout.environment import Environment, EnvReply, EnvStart, StateLost
from rollout.routed_env import routing_column
from rollout.tool_env import tool_calls_reply
from rollout.tool_parsing import ParsedTurn
from rollout.tools import tool_schema

RESERVED = ("reset", "get_reward")


def is_trl_environment(cls: Any) -> bool:
    """A class with TRL's shape: not a Temper `Environment`, and a `reset` that takes the row as keywords (TRL calls
    `reset(**row)`; Temper's `reset(row)` takes it positionally). A TRL class may have a tool named `step`."""
    if not isinstance(cls, type) or issubclass(cls, Environment) or not callable(getattr(cls, "reset", None)):
        return False
    reset: Any = getattr(cls, "reset")  # noqa: B009 - mypy narrows cls to a bare type
    params = list(inspect.signature(reset).parameters.values())[1:]  # after self
    return not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def tool_methods(cls: Any) -> list[str]:
    """The public methods TRL offers as tools."""
    return [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if n not in RESERVED and not n.startswith("_")]


@dataclass(frozen=True)
class Kept:
    """An episode's state: its instance's key in the worker that keeps it."""

    key: str


class TRLEnvironment(Environment):
    """A TRL-style class as a Temper environment (module docstring); built once per worker."""

    def __init__(self, factory: str, tool_timeout_s: float = 30.0):
        self.cls: Any = resolve(factory, "environment")
        if not is_trl_environment(self.cls):
            raise TypeError(f"{factory} is not a TRL-style environment class (reset(**kwargs))")
        names = tool_methods(self.cls)
        if inspect.iscoroutinefunction(getattr(self.cls, "reset", None)):
            raise TypeError(f"{factory}: reset is a coroutine; TRL calls it synchronously (reset(**row) -> str | None)")
        asynchronous = [n for n in [*names, "get_reward"] if inspect.iscoroutinefunction(getattr(self.cls, n, None))]
        self.schemas = {n: tool_schema(getattr(self.cls, n)) for n in names}
        self.tool_timeout_s = tool_timeout_s
        self.kept: dict[str, Any] = {}  # the episodes' instances, by their keys
        self.loop = EventLoop() if asynchronous else None  # the class's coroutines' loop

    def reset(self, row: dict) -> EnvStart:
        instance = self.cls()
        observation = instance.reset(**row)
        content = str(row.get("prompt", ""))
        if observation is not None:
            content += str(observation)
        key = secrets.token_hex(8)
        self.kept[key] = instance  # kept here, its episode pinned to this worker (it may hold a socket, a client)
        messages, tools = [{"role": "user", "content": content}], list(self.schemas.values())
        return EnvStart(messages, tools, state=Kept(key), pinned=True)

    def step(self, state: Kept, turn: ParsedTurn) -> EnvReply:
        instance = self._instance(state)
        functions = {name: self._synchronous(getattr(instance, name)) for name in self.schemas}
        reply = tool_calls_reply(turn, functions, self.schemas, self.tool_timeout_s, state)
        if reply is not None:
            return reply
        reward = getattr(instance, "get_reward", None)
        value = float(self._synchronous(reward)()) if callable(reward) else 0.0
        self.release(state)
        return EnvReply(done=True, reward=value, state=state)

    def release(self, state: Kept) -> None:
        self.kept.pop(state.key, None)

    def _synchronous(self, method: Any) -> Any:
        """`method`, or for a coroutine method a function that runs it on the worker's loop and returns its value."""
        if not inspect.iscoroutinefunction(method):
            return method
        assert self.loop is not None  # built for the class's coroutines
        loop = self.loop
        return functools.wraps(method)(lambda **kwargs: loop.run(method(**kwargs)))

    def _instance(self, state: Kept) -> Any:
        if state.key not in self.kept:
            raise StateLost(f"this worker no longer keeps the episode's {self.cls.__name__} (restarted or resumed)")
        return self.kept[state.key]


class EventLoop:
    """An event loop in a daemon thread, run for the calling thread: one per worker for a class's coroutines (TRL
    runs them on one loop too), so what an instance bound to it (a client, a queue) works in its later calls."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="trl-environment-loop", daemon=True).start()

    def run(self, coroutine: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:  # a tool past its deadline (the caller's TimeoutError): stop it too
            future.cancel()
            raise


def environment_spec(spec: str | dict, kwargs: dict) -> tuple[str, dict]:
    """The spec and kwargs the workers build: a TRL-style class goes through `TRLEnvironment` (its kwargs are the
    adapter's: `tool_timeout_s`), a mapping of environments by name through `rollout.routed_env` (its kwargs: each
    environment's under its name, and `column`); any other as it is."""
    if isinstance(spec, dict):
        column = routing_column(kwargs)
        per_name = {k: v for k, v in kwargs.items() if k != "column"}
        return "rollout.routed_env:RoutedEnvironment", {
            "environments": dict(spec),
            "kwargs": per_name,
            "column": column,
        }
    try:
        cls = resolve(spec, "environment")
    except Exception:
        return spec, kwargs  # the runner's check names what is wrong
    if is_trl_environment(cls):
        return "rollout.trl_env:TRLEnvironment", {"factory": spec, **kwargs}
    return spec, kwargs
