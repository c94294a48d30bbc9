"""Environments of multi-turn rollouts: plugins, as reward functions are, run in the crash- and hang-proof pool.

    class Guess(Environment):                          # my_envs.py
        def reset(self, row):                          # a row starts an episode
            return EnvStart([{"role": "user", "content": "Guess my number (1-10)."}], state=row["n"])
        def step(self, state, turn):                   # each assistant turn goes to the environment
            if turn.content.strip() == str(state):
                return EnvReply([], reward=1.0, done=True, state=state)
            return EnvReply([{"role": "user", "content": "No, try again."}], state=state)

    agent.environment: my_envs.py:Guess                # or package.module:Class, an entry point, or `tools`

An episode starts from a row: `reset(row)` gives the conversation the model starts from, the JSON schemas of
the tools it is offered (`rollout.tools.tool_schema`; the chat template renders them) and the episode's state.
Each assistant turn goes to `step(state, turn)` as a `rollout.tool_parsing.ParsedTurn` (its text, its tool calls
as vLLM's parser for the family reads them, or why a call could not be read), which answers with the messages
to append (tool results, a user turn), an optional reward, whether the episode is done, and the next state.

State is a value, not an object's memory: it travels with each call and back (it must pickle), so any worker can
take any step and a worker that dies loses nothing; an environment whose state is a worker's memory says so
(`EnvStart.pinned`) and its episode's steps all go to that worker. (A checkpoint stores finished steps; the
episodes in flight are sampled again by a resumed run.)
An environment is built once per worker from its spec and `agent.environment_kwargs`. `reset` and `step` run in
the worker pool (`rewards.pool.WorkerPool.call`) under `agent.env_timeout_s`: an environment that raises, hangs,
kills its worker or returns something that is not an `EnvStart` / `EnvReply` fails that episode (it trains on
nothing: its group is dropped, as for a failed reward) and is counted, never a crashed run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rewards.pool import Call, WorkerPool
from rollout.tool_parsing import ParsedTurn


@dataclass
class EnvStart:
    """How an episode starts: the conversation the model continues, the tools it is offered, the state."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)  # JSON schemas, as `rollout.tools.tool_schema` makes them
    state: Any = None
    # The state refers to what the worker that ran the reset keeps in its memory (an object that does not pickle):
    # every step of the episode goes to that worker (`Pinned`), and `release(state)` is called if it ends without
    # the environment saying done. Lost with its worker (`StateLost`): the episode restarts.
    pinned: bool = False


@dataclass(frozen=True)
class Pinned:
    """A pinned episode's state as the run holds it: the worker that keeps what it refers to, and the state."""

    worker: int
    state: Any


class StateLost(LookupError):
    """Raised by an environment whose pinned state is no longer in this worker's memory (the worker was replaced,
    or the run resumed from a checkpoint): the episode's failure is not the model's, and it is started again."""


@dataclass
class EnvReply:
    """The environment's answer to one assistant turn."""

    messages: list[dict] = field(default_factory=list)  # appended after the turn (ignored when done)
    reward: float = 0.0
    done: bool = False
    state: Any = None
    tool_calls: int = 0  # calls the turn made that the environment ran (metrics)
    tool_errors: int = 0  # of which failed: unknown tool, bad arguments, raised, timed out, bad result


class Environment:
    """Base class with defaults: an episode of one turn, the row's `prompt` (or `messages`) as its start."""

    def reset(self, row: dict) -> EnvStart:
        if "messages" in row:
            return EnvStart([dict(m) for m in row["messages"]])
        return EnvStart([{"role": "user", "content": str(row["prompt"])}])

    def step(self, state: Any, turn: ParsedTurn) -> EnvReply:
        return EnvReply(done=True, state=state)


@dataclass(frozen=True)
class EnvFailure:
    """A reset or step that gave no usable answer, and why. `infrastructure`: the call timed out or killed its
    worker (not an answer the environment chose to give: what a retry may fix)."""

    message: str
    infrastructure: bool = False
    state_lost: bool = False  # of which: the worker that kept the episode's state no longer has it (`StateLost`)


class EnvironmentRunner:
    """The run's side of an environment: its resets and steps as calls into the worker pool, each checked."""

    def __init__(self, spec: str | dict, kwargs: dict, pool: WorkerPool, timeout_s: float):
        from rollout.trl_env import environment_spec

        # A class written for TRL's environment_factory runs through its adapter (rollout/trl_env.py).
        self.spec, self.kwargs = environment_spec(spec, dict(kwargs))
        self.pool, self.timeout_s = pool, timeout_s

    def check(self) -> None:
        """Build the environment here once, so that one that cannot be imported or built fails at start, naming
        it (the workers build their own)."""
        from rewards.registry import resolve

        env = resolve(self.spec, "environment")(**self.kwargs)
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"environment {self.spec!r} has no {method}() method")

    def reset(self, rows: Sequence[dict]) -> list[EnvStart | EnvFailure]:
        calls = [Call("environment", self.spec, self.kwargs, "reset", (dict(r),)) for r in rows]
        results = self.pool.call(calls, self.timeout_s)
        starts = [self._checked(r, EnvStart, "reset") for r in results]
        for start, result in zip(starts, results, strict=True):
            if isinstance(start, EnvStart) and start.pinned:
                assert result.worker is not None  # a call that returned ran on a worker
                start.state = Pinned(result.worker, start.state)
        return starts

    def step(self, states: Sequence[Any], turns: Sequence[ParsedTurn]) -> list[EnvReply | EnvFailure]:
        calls = [self._call("step", s, t) for s, t in zip(states, turns, strict=True)]
        replies = [self._checked(r, EnvReply, "step") for r in self.pool.call(calls, self.timeout_s)]
        for state, reply in zip(states, replies, strict=True):
            if isinstance(state, Pinned) and isinstance(reply, EnvReply):
                reply.state = Pinned(state.worker, reply.state)
        return replies

    def release(self, states: Sequence[Any]) -> None:
        """Let the workers drop what pinned episodes that ended without the environment saying done kept (an
        environment without `release` keeps nothing to drop; a failed release loses nothing)."""
        calls = [self._call("release", s) for s in states if isinstance(s, Pinned)]
        if calls:
            self.pool.call(calls, self.timeout_s)

    def _call(self, method: str, state: Any, *args: Any) -> Call:
        if isinstance(state, Pinned):  # to the worker that keeps it, unwrapped
            return Call("environment", self.spec, self.kwargs, method, (state.state, *args), worker=state.worker)
        return Call("environment", self.spec, self.kwargs, method, (state, *args))

    def _checked(self, result, kind: type[EnvStart] | type[EnvReply], method: str) -> Any:
        if result.error is not None:
            gone = result.error.startswith(f"{StateLost.__name__}: ")
            lost = gone or result.error.startswith(("timed out", "its worker died"))
            return EnvFailure(f"{self.spec}.{method}: {result.error}", infrastructure=lost, state_lost=gone)
        value: Any = result.value
        if not isinstance(value, kind):
            return EnvFailure(f"{self.spec}.{method} returned a {type(value).__name__}, not a {kind.__name__}")
        bad = _bad_messages(value.messages)
        if bad:
            return EnvFailure(f"{self.spec}.{method}: {bad}")
        if isinstance(value, EnvReply):
            try:
                value.reward = float(value.reward)
            except (TypeError, ValueError):
                return EnvFailure(f"{self.spec}.step: reward {value.reward!r} is not a number")
            if value.reward != value.reward or abs(value.reward) == float("inf"):
                return EnvFailure(f"{self.spec}.step: reward {value.reward!r} is not finite")
        return value


def _bad_messages(messages: Any) -> str | None:
    """What is wrong with a list of chat messages, or None."""
    if not isinstance(messages, list):
        return f"messages must be a list of chat messages, not a {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            return f"message {i} is not a chat message with a role and a content: {m!r}"[:300]
    return None
