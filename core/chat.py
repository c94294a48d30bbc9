"""Chat conversations -> token ids and the assistant tokens a loss trains on, with the tokenizer's own template.

    ids, targets = render_chat(tokenizer, messages)                     # every assistant turn's tokens (SFT)
    prompt_ids, completion_ids = split_last_turn(tokenizer, messages)   # the last assistant turn (preference pairs)

Chat templates as model families ship them are not prefix-stable: Qwen3 drops the reasoning of earlier turns
and writes a think block into the last one, DeepSeek-R1 strips reasoning from the history and prefills
`<think>\\n` in its generation prompt, gpt-oss closes the last turn with `<|return|>` and earlier ones with
`<|end|>`, Phi-3 appends EOS when no generation prompt is asked for, Mistral moves the system prompt into the
last user turn. Rendering a conversation prefix by prefix and comparing therefore fails on them. Instead, each
assistant turn is located in ONE rendering of the whole conversation (the text the model trains on):

- it starts where the conversation before it, rendered with a generation prompt (what a sampler gives the model),
  stops agreeing with that rendering: the end of the generation prompt when it is a prefix (most templates), or
  the point inside it where the two part (DeepSeek-R1 and Nemotron prefill `<think>` text the history does not
  have). Where the two already disagree before the generation prompt (Mistral's moved system prompt), and for a
  turn that opens the conversation, the turn starts at its own content;
- it ends with the first end-of-turn token after its content: a special token the template writes right after an
  assistant message (found once per template by rendering a probe conversation; `<|im_end|>`, `<|eot_id|>`,
  `<|end|>` and `<|return|>`, ...), or EOS; and with the EOS right after it where the template closes every
  assistant turn that way (Cohere2 / Command R7B: `<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`, the second being the
  token its generation stops on).

Everything in between is the model's to produce and becomes a target (the reasoning a template keeps, the empty
think block Qwen3 writes, gpt-oss's channel headers); system, user and tool turns never do. The text is tokenized
once, with offsets and without adding special tokens (the template writes its own BOS); a token is a target when
it overlaps a turn's span. The ids are the template's own, as `apply_chat_template(tokenize=True)` gives them.
A conversation the template cannot render, or an assistant turn whose content or end cannot be found in the
rendering, is a `ChatTemplateError` naming the message and why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from core.chat_template import (
    PROBE_ARGUMENT,
    PROBE_REPLY,
    PROBE_USER,
    ChatTemplateError,
    atomic_tokens,
    calling_turn,
    closing,
    render_template,
)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _token_boundary(text: str, at: int, atomic: Sequence[str]) -> int:
    """`at`, moved back to the start of an atomic token it would cut through (`<|end|>` vs `<|assistant|>` agree
    on `<|`)."""
    for token in atomic:
        start = text.rfind(token, max(0, at - len(token) + 1), at + len(token) - 1)
        if 0 <= start < at < start + len(token):
            return start
    return at


def _turn_start(
    tokenizer: Any, messages: Sequence[dict], i: int, text: str, cursor: int, atomic, tools: Sequence[dict] | None
) -> int | None:
    """Where assistant message i begins in `text` (see the module docstring), or None when the rendering of the
    conversation before it is not part of `text`."""
    prompt = render_template(tokenizer, messages[:i], True, tools)
    bare = render_template(tokenizer, messages[:i], False, tools) if i else ""
    generation = _token_boundary(prompt, _common_prefix(prompt, bare), atomic)  # where the generation prompt begins
    agree = _token_boundary(prompt, _common_prefix(prompt, text), atomic)
    return agree if agree >= generation and agree >= cursor else None


def _find_content(text: str, content: str, start: int) -> tuple[int, int] | None:
    """(start, end) of an assistant message's content in `text` at or after `start`: as given, stripped, or the
    part after its reasoning (templates that drop `<think>...</think>` from the history)."""
    for candidate in (content, content.strip(), content.split("</think>")[-1].strip()):
        if candidate:
            at = text.find(candidate, start)
            if at >= 0:
                return at, at + len(candidate)
    return None


def _past_tool_calls(text: str, message: dict, at: int, limit: int) -> int:
    """Where the tool calls of an assistant message end in `text[at:limit]` (`limit`: the first end-of-turn token
    after the turn's content): past each call's name and its arguments' values as JSON writes them (what every
    template renders of a call), so that a tool result that repeats one of them (`{"expression": "84"}` -> `84`)
    is not taken for the next message. The arguments are objects (`_with_argument_objects`)."""
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments")
        # Each value as JSON writes it, or a string as it is (Qwen3.5's and Nemotron's XML-style parameters).
        forms = [[v] for v in [function.get("name")]] + [[json.dumps(v), v] for v in (arguments or {}).values()]
        for candidates in forms:
            for piece in candidates:
                found = text.find(piece, at, limit) if isinstance(piece, str) and piece else -1
                if found >= 0:
                    at = found + len(piece)
                    break
    return at


def _with_argument_objects(messages: Sequence[dict]) -> list[dict]:
    """The messages with every tool call's `arguments` an object: OpenAI's JSON strings parsed (the templates
    write `arguments | tojson`, which would write a string's quotes and escapes into the call)."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls and any(isinstance(c.get("function", {}).get("arguments"), str) for c in calls):
            try:
                calls = [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    if isinstance(c.get("function", {}).get("arguments"), str)
                    else c
                    for c in calls
                ]
            except ValueError as err:
                raise ChatTemplateError(f"message {i}: a tool call's arguments are not JSON ({err})") from None
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def assistant_char_spans(
    tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [start, end) character spans of every assistant turn); `tools`: the JSON schemas
    the conversation offers, rendered as the template renders them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("the tokenizer has no chat template (tokenizer_config.json: chat_template)")
    messages = _with_argument_objects(messages)
    text = render_template(tokenizer, messages, False, tools)
    atomic = atomic_tokens(tokenizer)
    closing_of = closing(tokenizer)
    closers, then_eos = closing_of.closers, closing_of.then_eos
    closer_pattern = re.compile("|".join(re.escape(c) for c in closers)) if closers else None
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:  # a turn that opens the conversation has no prompt to render: it starts at its content
            start = _turn_start(tokenizer, messages, i, text, cursor, atomic, tools) if i else None
        except ChatTemplateError as err:
            raise ChatTemplateError(f"message {i}: the conversation before it: {err}") from None
        content = message.get("content") or ""
        if start is None:  # earlier turns render differently in the whole conversation: start at the content
            after = cursor
            previous = messages[i - 1].get("content") or "" if i else ""
            if previous.strip() and (found := _find_content(text, previous, cursor)) is not None:
                after = found[1]
            where = _find_content(text, content, after)
            if where is None:
                raise ChatTemplateError(
                    f"message {i}: the template renders the conversation before this assistant turn differently "
                    f"when the turn follows, and the turn's content is not found in the rendering either"
                    if i
                    else f"message {i}: this opening assistant turn's content is not found in the rendering"
                )
            start = where[0]
        if content.strip():
            where = _find_content(text, content, start)
            if where is None:
                raise ChatTemplateError(
                    f"message {i}: the template does not write this assistant turn's content as given (it rewrites "
                    f"it), so its tokens cannot be located"
                )
            content_end = where[1]
        else:
            content_end = start
        first = closer_pattern.search(text, content_end) if closer_pattern is not None else None
        calls_end = _past_tool_calls(text, message, content_end, first.start() if first else len(text))
        close = closer_pattern.search(text, calls_end) if closer_pattern is not None else None
        following = next((m for m in messages[i + 1 :] if m["role"] != "assistant"), None)
        boundary = _find_content(text, following.get("content") or "", calls_end) if following else None
        if close is None or (boundary is not None and boundary[0] < close.start()):
            if following is None and not text[content_end:].strip():
                end = content_end  # the template closes no final turn (nothing follows its content)
            else:
                raise ChatTemplateError(
                    f"message {i}: no end-of-turn token ({', '.join(closers) or 'none known'}) closes this assistant "
                    f"turn before the next message"
                )
        else:
            end = close.end()
            if close.group() in then_eos and text.startswith(tokenizer.eos_token, end):
                end += len(tokenizer.eos_token)  # the turn's EOS after its closer (Cohere2's END_OF_TURN_TOKEN)
        names = [c.get("function", c).get("name") for c in message.get("tool_calls") or []]
        if names and names[0] not in text[start:end]:
            raise ChatTemplateError(
                f"message {i}: the chat template does not write this assistant turn's tool calls (no "
                f"{names[0]!r} in its rendering), so they cannot be trained on"
            )
        spans.append((start, end))
        cursor = end
    return text, spans


def _encode(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _span_tokens(offsets: Sequence[tuple[int, int]], span: tuple[int, int], message: int) -> list[int]:
    start, end = span
    # A token that straddles the start is the model's too: " 5" after Mistral's `[/INST]`, where the turn starts at
    # its content (a header never shares a token with the content: special tokens and newlines end tokens).
    tokens = [k for k, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
    if not tokens:
        raise ChatTemplateError(f"message {message}: the assistant turn holds no token")
    return tokens


def render_chat(
    tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None
) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, positions of its assistant tokens). Assistant turns may carry
    `tool_calls` (Hugging Face's structure: `{"type": "function", "function": {"name", "arguments"}}`), rendered by
    the template as the model writes them, and are targets with them; `tool` messages are context; `tools` are the
    JSON schemas the conversation offers (`transformers.utils.get_json_schema`)."""
    text, spans = assistant_char_spans(tokenizer, messages, tools)
    ids, offsets = _encode(tokenizer, text)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    targets = [k for span, i in zip(spans, turns) for k in _span_tokens(offsets, span, i)]
    return ids, targets


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """The conversation rendered with a generation prompt (and the JSON schemas of the `tools` it offers, as the
    template renders them), tokenized as a sampler does: what the model is given to continue with an assistant
    turn. Tool calls' `arguments` may be OpenAI's JSON strings."""
    return _encode(tokenizer, render_template(tokenizer, _with_argument_objects(messages), True, tools))[0]


def continuation_ids(
    tokenizer: Any,
    messages: Sequence[dict],
    stop_token: str,
    tools: Sequence[dict] | None = None,
    called: Sequence[str] = (),
) -> list[int]:
    """The tokens the template puts after an assistant turn that ended on `stop_token` (the token the sampler
    stopped on, which the trajectory already holds) when `messages` (tool results, an environment's user turn)
    follow it, through the generation prompt of the next assistant turn. `called`: the names of the functions
    the turn called (gpt-oss names the function in the header of its result, and ends a calling turn with
    `<|call|>`, not `<|end|>`).

    Token-in / token-out: a multi-turn trajectory is extended by these tokens and never rendered again, so the
    model's own tokens are never decoded and re-encoded, and templates that rewrite the history (Qwen3 drops
    earlier think blocks) do not change what was sampled. They come from a probe conversation rendered without
    and with `messages`: what follows the probe reply's `stop_token` in the second rendering (or, for a stop token
    the template writes otherwise in the history, gpt-oss's final `<|return|>`, what follows the closer it writes
    there, `<|end|>`). A template that does not close an assistant turn with `stop_token`, or cannot render the
    messages, is a `ChatTemplateError` naming it."""
    reply = {"role": "assistant", "content": PROBE_REPLY}
    messages = _with_argument_objects(messages)
    if not called:
        return _continuation(tokenizer, messages, stop_token, tools, reply, PROBE_REPLY)
    try:  # the turn as it was, calling those functions; where the template cannot write calls, as a reply
        return _continuation(tokenizer, messages, stop_token, tools, calling_turn(called), PROBE_ARGUMENT)
    except ChatTemplateError as as_calls:
        try:
            return _continuation(tokenizer, messages, stop_token, tools, reply, PROBE_REPLY)
        except ChatTemplateError as as_reply:
            raise ChatTemplateError(f"after a turn of tool calls: {as_calls}; after a reply: {as_reply}") from None


def _continuation(
    tokenizer: Any, messages: Sequence[dict], stop_token: str, tools: Sequence[dict] | None, reply: dict, marker: str
) -> list[int]:
    roles = ", ".join(repr(m.get("role")) for m in messages)
    try:
        after = render_template(tokenizer, [{"role": "user", "content": PROBE_USER}, reply, *messages], True, tools)
    except ChatTemplateError as err:
        raise ChatTemplateError(f"messages ({roles}) after an assistant turn: {err}") from None
    at = after.rfind(marker)  # the probe turn's (last) call, or its reply
    close = after.find(stop_token, at + len(marker)) if at >= 0 else -1
    rewritten = closing(tokenizer).in_history.get(stop_token)
    if close < 0 and at >= 0 and rewritten is not None:
        # A final reply's end that the history writes otherwise (gpt-oss's `<|return|>` becomes `<|end|>`): the
        # sampled token stays, and what follows is what the template writes after the token it puts there.
        close, stop_token = after.find(rewritten, at + len(marker)), rewritten
    if close < 0:
        raise ChatTemplateError(
            f"the chat template does not close an assistant turn with {stop_token!r} (the token generation stopped "
            f"on), so what follows that turn cannot be appended to it; set the tokenizer's EOS to the token the "
            f"template ends an assistant turn with"
        )
    return _encode(tokenizer, after[close + len(stop_token) :])[0]


def split_last_turn(
    tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a conversation ending with an assistant turn: the prompt is the conversation
    before it rendered with a generation prompt (`chat_prompt_ids`), the completion the last assistant turn's
    tokens in the rendering of the whole conversation, through its end-of-turn token. Earlier assistant turns
    (a multi-turn preference prompt) are part of the prompt; `tools`: the JSON schemas the conversation offers,
    rendered by the template."""
    last = len(messages) - 1
    if not messages or messages[-1]["role"] != "assistant":
        raise ChatTemplateError("the conversation does not end with an assistant turn")
    if last == 0:
        raise ChatTemplateError("message 0: an assistant turn with nothing before it has no prompt")
    text, spans = assistant_char_spans(tokenizer, messages, tools)
    ids, offsets = _encode(tokenizer, text)
    completion = [ids[k] for k in _span_tokens(offsets, spans[-1], last)]
    try:
        prompt = chat_prompt_ids(tokenizer, messages[:-1], tools)
    except ChatTemplateError as err:
        raise ChatTemplateError(f"message {last}: the prompt before it: {err}") from None
    return prompt, completion
