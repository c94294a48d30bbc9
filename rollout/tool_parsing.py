"""Tool calls read from an assistant turn with vLLM's own tool parsers, for either sampler.

    parser = ToolCallParser("hermes", tokenizer, tools=[tool_schema(calculator)])
    parsers = ToolParsers("hermes", tokenizer)                     # a run's: one parser per set of tools, built once
    turn = parser.parse('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')
    turn.tool_calls       # [ToolCall("calculator", '{"expression": "2+2"}')]
    turn.malformed        # None; a message when the turn opens a call the parser cannot read

The parsers are the ones vLLM's OpenAI server uses for each family (`hermes` for Qwen2.5 / Qwen3, `llama3_json`,
`mistral`, `openai` for gpt-oss, ... : `vllm.tool_parsers.ToolParserManager`), run on the text of the turn the
sampler produced (the trajectory keeps its token ids; the text is only read). A turn that opens a tool call the
parser cannot read (the family's call marker is there, no call comes out) is `malformed`: the rollout sends the
model an error message, as the peers do, rather than taking the turn for a final answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.tools import ToolCall

# Attributes vLLM's parsers keep their call-opening marker in (Hermes' `<tool_call>`, Llama's `<|python_tag|>`,
# Mistral's `[TOOL_CALLS]`, ...).
_MARKER_ATTRIBUTES = ("tool_call_start_token", "bot_token", "tool_calls_start_token", "tool_call_prefix")


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn as the environment reads it: its text outside tool calls, the calls, and why a call in it
    could not be read (None: nothing malformed)."""

    text: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: str | None = None


def parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


class ToolCallParser:
    def __init__(self, name: str, tokenizer: Any, tools: Sequence[dict] = ()):
        """vLLM's parser `name` over `tokenizer` (a transformers tokenizer); `tools`: the JSON schemas offered."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"unknown tool parser {name!r}; vLLM has: {', '.join(parser_names())}") from None
        self.name = name
        self.parser = cls(tokenizer)
        self._log = logging.getLogger(cls.__module__)
        self.request: Any = ChatCompletionRequest(
            model="temper", messages=[{"role": "user", "content": ""}], tools=list(tools) or None
        )
        if tools:
            self.request = self.parser.adjust_request(self.request)
        markers = (getattr(self.parser, a, None) for a in _MARKER_ATTRIBUTES)
        self.markers = tuple(m for m in markers if isinstance(m, str) and m)

    def parse(self, text: str) -> ParsedTurn:
        # vLLM's parsers log a traceback for every call they cannot read; here such a turn is `malformed`, answered
        # with an error message the model reads and counted (`agent/tool_errors`): a sampled call that is not JSON
        # is the model's mistake, not the run's, and hundreds of tracebacks a step hid the run's own output. Only
        # what the parser logs while reading this turn is dropped.
        self._log.addFilter(_drop)
        try:
            info = self.parser.extract_tool_calls(text, self.request)
        except Exception as err:  # a parser that raises on odd text: the turn is malformed, not the run
            return ParsedTurn(text, text, [], f"the {self.name} parser failed on it: {type(err).__name__}: {err}")
        finally:
            self._log.removeFilter(_drop)
        calls = [ToolCall(c.function.name, c.function.arguments or "") for c in info.tool_calls or []]
        content = info.content if info.content is not None else ("" if calls else text)
        if info.tools_called and calls:
            return ParsedTurn(text, content, calls)
        opened = next((m for m in self.markers if m in text), None)
        if opened is not None:
            return ParsedTurn(text, text, [], f"it opens a tool call ({opened}) that could not be read as one")
        return ParsedTurn(text, content)


def _drop(record: logging.LogRecord) -> bool:
    return False


class ToolParsers:
    """vLLM's parser `name` for each set of tools an episode is offered, built once for the run (not per step)."""

    def __init__(self, name: str, tokenizer: Any):
        self.name, self.tokenizer = name, tokenizer
        self._built: dict[tuple[str, ...], ToolCallParser] = {}

    def for_tools(self, tools: Sequence[dict]) -> ToolCallParser:
        key = tuple(t["function"]["name"] for t in tools)
        if key not in self._built:
            self._built[key] = ToolCallParser(self.name, self.tokenizer, tools)
        return self._built[key]
