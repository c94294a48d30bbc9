"""Chat conversations -> token ids and the assistant tokens a loss trains on, with the tokenizer's own template.

    ids, targets = render_chat(tokenizer, messages)   # targets: positions of every assistant token

Assistant spans are found by rendering the conversation prefix by prefix, so
any chat template works, with or without `{% generation %}` markers: the span
of assistant message i runs from the end of `messages[:i]` rendered with a
generation prompt to the end of `messages[:i + 1]` rendered, minus template
text after the turn's closing special token (the newline Qwen's template puts
after `<|im_end|>`), so each turn's content and its end-of-turn token
(`<|im_end|>`, `<|eot_id|>`, EOS) are targets and nothing else is. The
rendered text is tokenized once, with offsets, and a token is a target when it
starts inside a span. A template that does not render a conversation's
prefixes as prefixes of it (one that rewrites earlier turns, as Qwen3's drops
earlier reasoning) is a `ChatTemplateError` naming the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.errors import UserError


class ChatTemplateError(UserError, ValueError):
    """A conversation the tokenizer's chat template cannot render into assistant spans."""


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_char_spans(tokenizer: Any, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [start, end) character spans of every assistant turn)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("the tokenizer has no chat template (tokenizer_config.json: chat_template)")
    text = _render(tokenizer, messages, False)
    specials = [t for t in tokenizer.all_special_tokens if t]
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        through = _render(tokenizer, messages[: i + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ChatTemplateError(
                f"message {i}: the chat template does not render the conversation's prefixes as prefixes of it "
                f"(it rewrites earlier turns), so assistant tokens cannot be located"
            )
        start, end = len(before), len(through)
        # The turn ends with its closing special token; template text after it (a newline) is not the model's.
        closes = [text.rfind(t, start, end) + len(t) for t in specials if text.rfind(t, start, end) >= start]
        if closes and not text[max(closes) : end].strip():
            end = max(closes)
        spans.append((start, end))
    return text, spans


def render_chat(tokenizer: Any, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, positions of its assistant tokens)."""
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    targets = [k for k, (a, _) in enumerate(offsets) if any(s <= a < e for s, e in spans)]
    return ids, targets
