"""The conversations an agent sends through the OpenAI-compatible endpoint, recorded as token trajectories.

    recorder = Recorder(tokenizer)
    call = recorder.prompt(messages, tools)       # the token ids to sample from, for this call's messages
    reply = recorder.record(call, out, parsed)    # out: the sampler's Completion; reply: the assistant message
    recorder.completions()                        # one trajectory per segment, what the trainer trains on

An agent written against an OpenAI client sends every call the whole conversation so far, as text. Rendering it
again each call would re-encode the model's own tokens, which need not give back the tokens it sampled (and Qwen3's
template drops earlier think blocks), so the trainer would score tokens the sampler never produced. The recorder
keeps instead, per episode, **segments**: a conversation's messages as of its last reply, and that conversation's
tokens exactly as the sampler saw and produced them.

A call whose messages **extend** a segment (the segment's messages, its last reply as the client got it, then new
messages: tool results, a user turn) continues that segment: its prompt is the segment's tokens plus what the chat
template writes for the new messages after the reply's stop token (`core.chat.continuation_ids`). A call may continue a
segment from any of its replies, not only the last: an agent that branches (several choices, `n` > 1, a retry of
a step, a search) **forks** it, and the fork shares the segment's tokens up to that reply. Any other call starts a
new segment from the template's rendering of its messages: the agent rewrote, summarised or dropped history,
edited a reply, changed the tools, or continues a turn that was cut at its token limit (no stop token to continue
after). Each segment is trained as a trajectory of its own (the model's tokens carry their log-probs, the
template's tokens are context); the one the latest reply went to (`Segment.replied`) is the episode's last.

Messages are compared by role, text and tool calls (name and parsed arguments), not by ids or field order: a
client that echoes the reply as `message.model_dump()` or as a dict of its own extends the segment alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.chat import chat_prompt_ids, continuation_ids
from rollout.sampler import Completion
from rollout.tool_parsing import ParsedTurn


def canonical(message: dict) -> tuple:
    """What two messages must share to be the same turn of a conversation."""
    content = message.get("content") or ""
    if isinstance(content, list):  # OpenAI's content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in message.get("tool_calls") or []:
        function = c.get("function", {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # not JSON: compared as written
                arguments = json.loads(arguments)
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), content, tuple(calls)


RAW = "\x00raw"  # the tools key of raw completion segments: no chat call continues one


def _tools_key(tools: Sequence[dict] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True)


@dataclass(frozen=True)
class Mark:
    """Where a segment can be continued: after a reply that ended on a stop token."""

    messages: int  # how many of the segment's messages come before (the reply included)
    tokens: int  # its token count after the reply
    stop: str  # the reply's stop token, decoded
    called: tuple[str, ...]  # the functions the reply called


@dataclass
class Segment:
    """One recorded conversation: its messages as of the last reply, its tokens, and the points it can be
    continued from (one after every reply that stopped)."""

    messages: list[tuple]  # canonical messages, the last reply's included
    tools_key: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # after the prompt
    sampled: list[bool] = field(default_factory=list)  # per token of token_ids: the model's (True)
    logprobs: list[float] = field(default_factory=list)  # per token: the sampler's (0.0 on the template's)
    marks: list[Mark] = field(default_factory=list)
    cut: bool = False  # the last turn was cut at its token limit
    turns: int = 0
    final_text: str = ""
    policy_version: int = 0
    replied: int = 0  # the episode's count of replies when this segment got its latest (the last: the episode's)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def completion(self) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason="length" if self.cut else "stop",
            text=self.final_text,
            policy_version=self.policy_version,
            sampled=list(self.sampled),
        )

    def until(self, mark: Mark) -> Segment:
        """A fork: this segment's messages, tokens and marks up to `mark`."""
        n = mark.tokens
        return Segment(
            self.messages[: mark.messages], self.tools_key, list(self.prompt_ids), self.token_ids[:n],
            self.sampled[:n], self.logprobs[:n], [m for m in self.marks if m.tokens <= n],
            turns=sum(m.tokens <= n for m in self.marks), policy_version=self.policy_version,
        )  # fmt: skip


@dataclass(frozen=True)
class Call:
    """A call's prompt: the tokens to sample from, and what recording its reply needs."""

    token_ids: list[int]
    messages: list[tuple]  # the call's canonical messages
    tools_key: str
    base: int | None  # the segment it continues (None: a new one)
    mark: Mark | None  # where in that segment
    context: list[int]  # the template's tokens for the call's new messages


class Recorder:
    """One episode's segments (module docstring). Thread-safe: an agent's calls may overlap."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.segments: list[Segment] = []
        self.closed = False  # finished: a call still in flight records nothing more
        self.replies = 0  # replies recorded, in every segment
        self._lock = threading.Lock()

    def close(self) -> list[Segment]:
        """Stop recording: copies of the segments as they are now (a late call's reply is refused, not added)."""
        with self._lock:
            self.closed = True
            return [
                dataclasses.replace(
                    s,
                    token_ids=list(s.token_ids),
                    sampled=list(s.sampled),
                    logprobs=list(s.logprobs),
                    marks=list(s.marks),
                )
                for s in self.segments
            ]

    def prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> Call:
        """The prompt of a call with `messages` (OpenAI's dicts) and `tools` (JSON schemas): the tokens of the
        recorded conversation it continues (the most messages; the latest segment on a tie) plus the template's
        for the new messages, or the rendering of them all (a new segment)."""
        want, key = [canonical(m) for m in messages], _tools_key(tools)
        if not want:
            raise ValueError("a chat call needs at least one message")
        best: tuple[int, Mark] | None = None
        with self._lock:
            for k, s in enumerate(self.segments):
                if s.tools_key != key:
                    continue
                for mark in s.marks:
                    n = mark.messages
                    continues = len(want) > n and want[n][0] != "assistant" and want[:n] == s.messages[:n]
                    if continues and (best is None or n >= best[1].messages):
                        best = (k, mark)
            if best is not None:
                k, mark = best
                base = self.segments[k]
                prefix = base.prompt_ids + base.token_ids[: mark.tokens]
        if best is None:
            return Call(chat_prompt_ids(self.tokenizer, messages, tools), want, key, None, None, [])
        context = continuation_ids(self.tokenizer, messages[mark.messages :], mark.stop, tools, mark.called)
        return Call(prefix + context, want, key, k, mark, context)

    def prompt_tokens(self, token_ids: Sequence[int]) -> Call:
        """The prompt of a raw completion call (`/v1/completions`): `token_ids` as given. It continues the latest
        raw segment whose tokens it starts with (what follows them is context), else starts one."""
        ids = [int(t) for t in token_ids]
        with self._lock:
            for k in reversed(range(len(self.segments))):
                s = self.segments[k]
                have = s.ids
                if s.tools_key == RAW and len(ids) > len(have) and ids[: len(have)] == have:
                    mark = Mark(len(s.messages), len(s.token_ids), "", ())
                    return Call(ids, [], RAW, k, mark, ids[len(have) :])
        return Call(ids, [], RAW, None, None, [])

    def record(self, call: Call, out: Completion, parsed: ParsedTurn, ended: bool | None = None) -> dict:
        """Record the sampler's turn `out` for `call` (its tokens and log-probs) and return the assistant message
        the client gets (`parsed`: the turn read by the family's tool parser). `ended`: the turn's last token is
        one the template closes a turn with (default: the sampler stopped); a turn cut at its limit, or stopped by
        a stop string, has no such token to continue after."""
        reply = assistant_message(parsed)
        stopped = bool(out.token_ids) and (out.finish_reason == "stop" if ended is None else ended)
        logprobs = list(out.logprobs) if out.logprobs is not None else [0.0] * len(out.token_ids)
        with self._lock:
            if self.closed:
                raise RuntimeError("the episode is finished: its recording is closed")
            if call.base is None:
                segment = Segment([], call.tools_key, list(call.token_ids), policy_version=out.policy_version)
                self.segments.append(segment)
            else:
                assert call.mark is not None
                segment = self.segments[call.base]
                # it went on past the point (or, in a chat, its last reply was cut): a fork
                moved = len(segment.token_ids) != call.mark.tokens
                if moved or (segment.cut and call.tools_key != RAW):
                    segment = segment.until(call.mark)
                    self.segments.append(segment)
                segment.token_ids += call.context
                segment.sampled += [False] * len(call.context)
                segment.logprobs += [0.0] * len(call.context)
            segment.token_ids += list(out.token_ids)
            segment.sampled += [True] * len(out.token_ids)
            segment.logprobs += logprobs
            segment.messages = [*call.messages, canonical(reply)]
            segment.turns += 1
            self.replies += 1
            segment.replied = self.replies
            segment.cut = not stopped
            segment.final_text = parsed.content
            if stopped:
                stop = self.tokenizer.decode(out.token_ids[-1:], skip_special_tokens=False)
                called = tuple(c.name for c in parsed.tool_calls)
                segment.marks.append(Mark(len(segment.messages), len(segment.token_ids), stop, called))
        return reply

    def completions(self) -> list[Completion]:
        """Every segment's trajectory, in the order they started."""
        with self._lock:
            return [s.completion() for s in self.segments]


def assistant_message(parsed: ParsedTurn) -> dict:
    """The OpenAI assistant message of a turn: its text outside tool calls, and its calls."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]  # fmt: skip
    elif message["content"] is None:
        message["content"] = ""
    return message
