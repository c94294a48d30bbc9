"""A reply's reasoning split from its content by vLLM's reasoning parser for the family, as vLLM's OpenAI server does
with `--reasoning-parser` (`rl.agent.reasoning_parser`).

    splitter = ReasoningSplitter("qwen3", tokenizer)
    splitter.split("<think>\\nadd them\\n</think>\\n\\nIt is 42.")   # -> ("\\nadd them\\n", "\\n\\nIt is 42.")

The endpoint (`rollout.endpoint`) returns the reasoning in the assistant message's `reasoning` field (vLLM's name;
`reasoning_content` too, the name older servers used and many agents read) and reads tool calls from the content
alone. Only the reply is split: the trajectory keeps every token the model sampled, think blocks included, and an
agent that sends the reply back with or without its reasoning still continues its segment (messages are compared by
their content and calls, `rollout.recording.canonical`). What the run's reward functions score of the episode's
last reply is its content, without the think block. vLLM's `qwen3` parser takes a reply that never closes its think
block (cut while thinking, or a model that does not think) as all reasoning: its content is empty.
"""

from __future__ import annotations

from typing import Any


def reasoning_parser_names() -> list[str]:
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


class ReasoningSplitter:
    def __init__(self, name: str, tokenizer: Any):
        """vLLM's reasoning parser `name` (qwen3, deepseek_r1, ...) over `tokenizer`; an unknown name is refused with
        the list of vLLM's."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning import ReasoningParserManager

        if name not in reasoning_parser_names():
            raise ValueError(f"unknown reasoning parser {name!r}; vLLM has: {', '.join(reasoning_parser_names())}")
        self.name = name
        self.parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
        self.request = ChatCompletionRequest(model="temper", messages=[{"role": "user", "content": ""}])

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None where there is none; the content, "" where there is none)."""
        reasoning, content = self.parser.extract_reasoning(text, self.request)
        return reasoning or None, content or ""
