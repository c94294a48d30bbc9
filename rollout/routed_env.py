"""Several environments in one run, each row choosing its own (TRL's multi-environment form, for any environment).

    agent:
      environment: {calculator: my_envs.py:Calculator, coding: coding}   # TRL-style classes, Temper's, built-ins
      environment_kwargs: {coding: {wall_s: 10}, column: environment}    # per name; the routing column

Each row names its environment in its `column` (TRL's `environment` field). Its episode is that environment's alone:
its `reset` gets the row without the routing field (as TRL passes it), the model is offered only its tools, and
every step goes back to it with its own state. A row naming no environment of the mapping fails its episode, named.
The state is (name, the environment's own state): it moves between the pool's workers as the inner state does, and
is pinned to one worker where the inner one is (a TRL-style instance).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rewards.registry import resolve
from rollout.environment import Environment, EnvReply, EnvStart
from rollout.tool_parsing import ParsedTurn

COLUMN = "environment"  # TRL's field: the column each row names its environment in, unless `column` renames it


def routing_column(kwargs: dict) -> str:
    """The column rows name their environment in: a mapping's `environment_kwargs.column`, else TRL's."""
    return kwargs.get("column", COLUMN)


@dataclass(frozen=True)
class Routed:
    """An episode's state: the name of its environment, and that environment's state."""

    name: str
    state: Any


class RoutedEnvironment(Environment):
    """Built once per worker: each named environment from its spec (`rollout.trl_env.environment_spec`: a TRL-style
    class through its adapter) and its kwargs (`kwargs[name]`)."""

    def __init__(self, environments: dict[str, str], kwargs: dict[str, dict] | None = None, column: str = COLUMN):
        from rollout.trl_env import environment_spec

        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - set(environments))
        if unknown:
            raise ValueError(
                f"environment_kwargs names {', '.join(unknown)}, not an environment of the mapping "
                f"({', '.join(environments)}): a mapping's kwargs go under each environment's name, beside `column`"
            )
        self.environments: dict[str, Any] = {}
        for name, spec in environments.items():
            built_spec, built_kwargs = environment_spec(spec, dict(kwargs.get(name) or {}))
            self.environments[name] = resolve(built_spec, "environment")(**built_kwargs)
        self.column = column

    def reset(self, row: dict) -> EnvStart:
        name = row.get(self.column)
        if name not in self.environments:
            known = ", ".join(self.environments)
            raise ValueError(f"the row's {self.column!r} is {name!r}, not one of {known}")
        start = self.environments[name].reset({k: v for k, v in row.items() if k != self.column})
        if not isinstance(start, EnvStart):  # checked by the runner too; here so the state below can be set
            raise TypeError(f"{name}.reset returned a {type(start).__name__}, not an EnvStart")
        return dataclasses.replace(start, state=Routed(name, start.state))

    def release(self, state: Routed) -> None:
        release = getattr(self.environments[state.name], "release", None)
        if callable(release):
            release(state.state)

    def step(self, state: Routed, turn: ParsedTurn) -> EnvReply:
        reply = self.environments[state.name].step(state.state, turn)
        if not isinstance(reply, EnvReply):
            raise TypeError(f"{state.name}.step returned a {type(reply).__name__}, not an EnvReply")
        return dataclasses.replace(reply, state=Routed(state.name, reply.state))
