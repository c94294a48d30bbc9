"""What a tokenizer's chat template writes: a conversation rendered as text, and the tokens that end its turns.

    text = render_template(tokenizer, messages, generation_prompt=True)   # `apply_chat_template`, errors named
    turn_stop_ids(tokenizer)       # the ids a sampler stops a turn on (EOS and the template's end of turn)
    closing(tokenizer)             # the special token the template writes after an assistant turn, and its forms

The end-of-turn tokens are found once per template by rendering a probe conversation (a user question, an
assistant reply, a tool call and its result) and reading the special tokens the template writes after the
reply; `core.chat` locates assistant turns with them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import UserError


class ChatTemplateError(UserError, ValueError):
    """A conversation the tokenizer's chat template cannot render into assistant spans."""


# A probe conversation, rendered once per template to learn which special token closes an assistant turn.
PROBE_USER, PROBE_REPLY = "Probe question 7?", "Probe reply 7."
PROBE_ARGUMENT, PROBE_RESULT = "probe-argument-7", "probe-result-7"


def calling_turn(names: Sequence[str]) -> dict:
    """A probe assistant turn that calls the functions `names` (each with one argument, `PROBE_ARGUMENT`)."""
    calls = [{"type": "function", "function": {"name": n, "arguments": {"x": PROBE_ARGUMENT}}} for n in names]
    return {"role": "assistant", "content": "", "tool_calls": calls}


_closers_cache: dict[tuple, Closing] = {}


def render_template(
    tokenizer: Any, messages: Sequence[dict], generation_prompt: bool, tools: Sequence[dict] | None = None
) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
    except Exception as err:  # jinja's TemplateError, the template's raise_exception(...), an undefined field
        reason = str(err).splitlines()[0] if str(err) else ""
        raise ChatTemplateError(f"the chat template cannot render it ({type(err).__name__}: {reason})") from None


def tool_call_closer(tokenizer: Any, specials: re.Pattern | None) -> set[str]:
    """The special token that ends a turn of tool calls when the tools' results follow (empty where the template
    writes no calls, or no special token follows them). Probed with two calls where the template writes two: a
    token it writes between the calls closes one call (Kimi's `<|tool_call_end|>`), not the turn. A closing tag
    whose opening tag the call has (`</tool_call>` after `<tool_call>`, were they special) is part of the call as
    parsers read it; EOS always ends the turn."""
    if specials is None:
        return set()
    user = {"role": "user", "content": PROBE_USER}
    result = {"role": "tool", "name": "probe_tool", "content": PROBE_RESULT}
    for calls in (2, 1):
        try:
            text = render_template(tokenizer, [user, calling_turn(["probe_tool"] * calls), result], False)
        except ChatTemplateError:
            continue
        first, last, ends = text.find(PROBE_ARGUMENT), text.rfind(PROBE_ARGUMENT), text.find(PROBE_RESULT)
        if first < 0 or ends < 0 or text.count(PROBE_ARGUMENT) != calls:
            continue
        between = {m.group() for m in specials.finditer(text, first, last)}  # written per call
        opened = text[text.find(PROBE_USER) : last]
        for found in specials.finditer(text, last + len(PROBE_ARGUMENT), ends):
            token = found.group()
            if token == tokenizer.eos_token:
                return {token}
            if token in between or (token.startswith("</") and "<" + token[2:] in opened):
                continue
            return {token}
        return set()
    return set()


def atomic_tokens(tokenizer: Any) -> list[str]:
    """Every special or added token's text, longest first (none of them is ever split by the tokenizer)."""
    found = {t for t in tokenizer.all_special_tokens if t}
    found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.content}
    return sorted(found, key=len, reverse=True)


def special_tokens(tokenizer: Any) -> list[str]:
    found = {t for t in tokenizer.all_special_tokens if t}
    found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special and t.content}
    return sorted(found, key=len, reverse=True)


def end_of_turn_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokens that close an assistant turn in this template's renderings: EOS, the first special token the
    template writes after an assistant reply, as the last message and followed by a user turn, and after a turn
    that calls a tool and is followed by the tool's result (gpt-oss's `<|call|>`, GLM's `<|observation|>`)
    (cached per template). Where SFT's targets of a turn end."""
    return closing(tokenizer).closers


def turn_stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens a sampled assistant turn ends on: EOS, the token closing a reply that is the conversation's last
    message (or, where the template writes none there, the one before the next user turn: GLM's `<|user|>`), and
    the one closing a tool-calling turn (gpt-oss's `<|call|>`, GLM's `<|observation|>`). The tokenizer's EOS alone
    misses a base model's tokenizer whose EOS is `<|endoftext|>` while its template closes turns with
    `<|im_end|>`; every closer would stop gpt-oss after its analysis channel (`<|end|>`, where its history's turns
    end) and Cohere2 before the EOS its turns end with."""
    ids = set()
    for token in closing(tokenizer).stops:
        found = tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found != tokenizer.unk_token_id:
            ids.add(found)
    return tuple(sorted(ids))


def written_turn_ends(tokenizer: Any) -> frozenset[str]:
    """The turn ends the template itself writes, after a reply or a turn of tool calls (not a base model's EOS,
    which a ChatML template never writes): the ones a conversation can go on after."""
    return closing(tokenizer).written


@dataclass(frozen=True)
class Closing:
    closers: tuple[str, ...]  # longest first
    then_eos: frozenset[str]  # closers the template follows with EOS after a reply a user turn follows
    stops: frozenset[str]  # what generation stops on (`turn_stop_ids`)
    written: frozenset[str]  # the turn ends the template itself writes (after a reply, a call)
    in_history: dict[str, str]  # a final reply's closer -> the one the history writes instead (gpt-oss)


def closing(tokenizer: Any) -> Closing:
    """How this template ends assistant turns (probe conversations rendered once per template)."""
    specials = special_tokens(tokenizer)
    eos = tokenizer.eos_token
    key = (tokenizer.chat_template, eos, tuple(specials))
    if key not in _closers_cache:
        found_after: dict[int, str] = {}  # probe length -> the first special token after the reply
        then_eos: set[str] = set()
        user, reply = {"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_REPLY}
        pattern = re.compile("|".join(re.escape(s) for s in specials)) if specials else None
        for probe in ([user, reply], [user, reply, user]):
            try:
                text = render_template(tokenizer, probe, False)
            except ChatTemplateError:
                continue
            at = text.find(PROBE_REPLY)
            found = pattern.search(text, at + len(PROBE_REPLY)) if pattern is not None and at >= 0 else None
            if found is not None:
                found_after[len(probe)] = found.group()
                if len(probe) == 3 and eos and found.group() != eos and text.startswith(eos, found.end()):
                    then_eos.add(found.group())
        final, history = found_after.get(2), found_after.get(3)  # after a last reply, and one a user turn follows
        calling = tool_call_closer(tokenizer, pattern)
        written = set(found_after.values()) | calling
        base = {eos} if eos else set()
        last = final or history
        stops = base | calling | ({last} - then_eos if last else set())
        _closers_cache[key] = Closing(
            tuple(sorted(base | written, key=len, reverse=True)),
            frozenset(then_eos),
            frozenset(stops),
            frozenset(written),
            {final: history} if final and history and final != history else {},
        )
    return _closers_cache[key]
