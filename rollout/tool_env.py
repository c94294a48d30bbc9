"""The built-in `tools` environment: the model calls tools until it answers without one.

    agent:
      environment: tools
      environment_kwargs: {tools: [calculator, my_tools.py:lookup], system_prompt: "Use the calculator."}

An episode starts from the row's prompt (the formatted `rl.prompt_template`, or the row's `messages`), after an
optional system prompt, with the tools' JSON schemas offered (`rollout.tools.tool_schema`; tools are named as
reward functions are: a built-in, `package.module:function`, `path/to/file.py:function`, an entry point of
`temper.tools`). Each assistant turn's tool calls run in order under `tool_timeout_s` each and their replies go
back as `tool` messages; a call the parser could not read goes back as an error in a `tool` message too. A turn
without a call is the answer: the episode ends, and the run's reward functions score that turn's text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rewards.registry import resolve
from rollout.environment import Environment, EnvReply, EnvStart
from rollout.tool_parsing import ParsedTurn
from rollout.tools import ToolReply, call_tool, tool_messages, tool_schema


class ToolEnvironment(Environment):
    def __init__(self, tools: Sequence[str] = (), system_prompt: str | None = None, tool_timeout_s: float = 5.0):
        if not tools:
            raise ValueError("the tools environment needs at least one tool (environment_kwargs.tools)")
        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: dict[str, dict] = {}
        for spec in tools:
            fn = resolve(spec, "tool")
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}")
            self.functions[name], self.schemas[name] = fn, schema
        self.system_prompt = system_prompt
        self.tool_timeout_s = tool_timeout_s

    def reset(self, row: dict) -> EnvStart:
        start = super().reset(row)
        if self.system_prompt and not (start.messages and start.messages[0]["role"] == "system"):
            start.messages.insert(0, {"role": "system", "content": self.system_prompt})
        start.tools = list(self.schemas.values())
        return start

    def step(self, state: Any, turn: ParsedTurn) -> EnvReply:
        reply = tool_calls_reply(turn, self.functions, self.schemas, self.tool_timeout_s, state)
        return reply if reply is not None else EnvReply(done=True, state=state)


def tool_calls_reply(
    turn: ParsedTurn,
    functions: Mapping[str, Callable[..., Any]],
    schemas: Mapping[str, dict],
    timeout_s: float,
    state: Any,
) -> EnvReply | None:
    """The reply to a turn that calls tools, as every tool-offering environment gives it: a call the parser could
    not read comes back as an error, the calls run in order (each checked against its schema, under `timeout_s`),
    their results or errors as `tool` messages. None: the turn called nothing (the answer; the environment ends
    the episode with its own reward)."""
    if turn.malformed is not None:
        message = {"role": "tool", "content": f"Error: your tool call could not be read: {turn.malformed}."}
        return EnvReply([message], state=state, tool_calls=1, tool_errors=1)
    if not turn.tool_calls:
        return None
    replies: list[ToolReply] = [
        call_tool(functions.get(c.name), schemas.get(c.name), c, timeout_s) for c in turn.tool_calls
    ]
    errors = sum(r.error is not None for r in replies)
    return EnvReply(tool_messages(turn.tool_calls, replies), state=state, tool_calls=len(replies), tool_errors=errors)
