"""Multi-turn episodes, token in / token out: the model and an environment take turns until the episode ends.

    episodes = run_episodes(samplers.generate, env, tokenizer, rows, limits, params, ToolParsers("hermes", tokenizer))
    completions = [e.completion() for e in episodes]   # what the trainer's batch is built from

Each episode starts from the environment's `reset(row)`: its messages and tools, rendered once by the chat
template with a generation prompt (the prompt's token ids). Then, turn after turn, the sampler continues from the
trajectory's token ids (a new request over the whole history, so a prefix cache reuses it), the turn's text is
read by vLLM's tool parser for the family (`rollout.tool_parsing`), and the environment answers; the tokens its
messages take (`core.chat.continuation_ids`: what the template writes after the turn's stop token through the
next generation prompt) are appended. The sampled tokens are never decoded and encoded again, and the history is
never rendered again, so the trajectory the trainer sees is exactly the prompt's tokens, the sampler's tokens and
the environment's tokens, with the sampler's log-probs on its own; `sampled` marks which tokens train.

Limits (`agent.*`): `max_turns` assistant turns; `rollout.max_tokens` tokens a turn; `rollout.max_model_len` tokens
for the whole trajectory (prompt and every turn). An episode that runs out of tokens (a turn cut at its limit, or
no room for the environment's answer or another turn) ends truncated (`finish_reason="length"`, handled as an
overlong completion is: `rl.loss.mask_truncated`); one that runs out of turns (`finish="turns"`) never answered and
is handled the same way. An
environment that fails (`rollout.environment.EnvFailure`) ends its episode as `failed`: it trains on nothing.
Active episodes advance together, one sampler request a turn, each as far as its own limits allow.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core.chat import ChatTemplateError, chat_prompt_ids, continuation_ids
from rollout.environment import EnvFailure, EnvironmentRunner, EnvReply
from rollout.sampler import Completion, SamplingParams, sample_seed
from rollout.tool_parsing import ParsedTurn, ToolParsers

Finish = Literal["done", "length", "turns", "failed"]
Generate = Callable[[list[list[int]], SamplingParams], list[Completion]]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    turn_tokens: int  # rollout.max_tokens: tokens an assistant turn may take
    total_tokens: int  # rollout.max_model_len: the whole trajectory, prompt included


@dataclass
class Episode:
    """One trajectory: the prompt's tokens, then the model's and the environment's tokens in turn."""

    row: dict
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # everything after the prompt
    sampled: list[bool] = field(default_factory=list)  # per token of token_ids: the model's (True) or not
    logprobs: list[float] = field(default_factory=list)  # per token: the sampler's (0.0 on environment tokens)
    tools: list[dict] = field(default_factory=list)
    state: Any = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    rewards: list[float] = field(default_factory=list)  # the environment's, per turn
    env_seconds: float = 0.0
    finish: Finish | None = None  # None: still running
    error: str | None = None  # why it failed
    final_text: str = ""  # the last assistant turn's text (what reward functions score)
    policy_version: int = 0  # of its first turn

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def completion(self) -> Completion:
        """The trajectory as the trainer's batch takes it: every token after the prompt, the environment's
        marked as not sampled (context, no loss)."""
        return Completion(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason="length" if self.finish in ("length", "turns") else "stop",  # it never answered
            text=self.final_text,
            policy_version=self.policy_version,
            sampled=list(self.sampled),
        )

    def _append(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids.extend(int(t) for t in ids)
        self.sampled.extend([sampled] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def run_episodes(
    generate: Generate,
    env: EnvironmentRunner,
    tokenizer: Any,
    rows: Sequence[dict],
    limits: EpisodeLimits,
    params: SamplingParams,
    parsers: ToolParsers,
) -> list[Episode]:
    """Run one episode per row to its end (`params`: the per-turn sampling, n = 1; its seed is mixed with each
    turn's index so that no two turns share a random stream)."""
    episodes = [Episode(dict(r)) for r in rows]
    t0 = time.perf_counter()
    for episode, start in zip(episodes, env.reset(rows), strict=True):
        if isinstance(start, EnvFailure):
            episode.finish, episode.error = "failed", start.message
            continue
        episode.tools, episode.state = start.tools, start.state
        try:
            episode.prompt_ids = chat_prompt_ids(tokenizer, start.messages, start.tools)
        except ChatTemplateError as err:
            episode.finish, episode.error = "failed", f"the start of the episode cannot be rendered: {err}"
            continue
        if episode.length >= limits.total_tokens:
            episode.finish, episode.error = (
                "failed",
                (f"the prompt takes {episode.length} tokens of rollout.max_model_len={limits.total_tokens}"),
            )
    _share(episodes, time.perf_counter() - t0)
    turn = 0
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            return episodes
        room = [min(limits.turn_tokens, limits.total_tokens - e.length) for e in active]
        outs = _sample(generate, active, room, params, turn)
        turn += 1
        stepping: list[tuple[Episode, ParsedTurn]] = []
        for episode, out, limit in zip(active, outs, room, strict=True):
            ids, logps = list(out.token_ids[:limit]), list((out.logprobs or [0.0] * len(out.token_ids))[:limit])
            if episode.turns == 0:
                episode.policy_version = out.policy_version
            episode._append(ids, True, logps)
            episode.turns += 1
            stopped = out.finish_reason == "stop" and len(out.token_ids) <= limit and bool(ids)
            text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
            episode.final_text = tokenizer.decode(ids, skip_special_tokens=True)
            if not stopped:
                episode.finish = "length"
                continue
            stepping.append((episode, parsers.for_tools(episode.tools).parse(text)))
        if not stepping:
            continue
        t1 = time.perf_counter()
        replies = env.step([e.state for e, _ in stepping], [p for _, p in stepping])
        _share([e for e, _ in stepping], time.perf_counter() - t1)
        for (episode, parsed), reply in zip(stepping, replies, strict=True):
            _take(episode, parsed, reply, tokenizer, limits)


def _sample(
    generate: Generate, active: list[Episode], room: list[int], params: SamplingParams, turn: int
) -> list[Completion]:
    """Each active episode's next turn, at most its `room` tokens: one request per distinct room (a sampler refuses
    a prompt whose length plus `max_tokens` exceeds the model length, and episodes near the budget have less), its
    seed mixed from the run's, the turn and the room, so that no two turns or episodes share a random stream."""
    outs: list[Completion | None] = [None] * len(active)
    for limit in sorted(set(room)):
        members = [i for i, r in enumerate(room) if r == limit]
        seed = None if params.seed is None else sample_seed(params.seed, turn, limit)
        turn_params = dataclasses.replace(params, n=1, max_tokens=limit, seed=seed, logprobs=True)
        got = generate([active[i].prompt_ids + active[i].token_ids for i in members], turn_params)
        for i, out in zip(members, got, strict=True):
            outs[i] = out
    return [o for o in outs if o is not None]


def _take(episode: Episode, parsed: ParsedTurn, reply: EnvReply | EnvFailure, tokenizer, limits: EpisodeLimits):
    """The environment's answer to the episode's last turn: its reward, its messages' tokens, or the end."""
    if isinstance(reply, EnvFailure):
        episode.finish, episode.error = "failed", reply.message
        return
    episode.state = reply.state
    episode.rewards.append(reply.reward)
    episode.tool_calls += reply.tool_calls
    episode.tool_errors += reply.tool_errors
    episode.final_text = parsed.content
    if reply.done:
        episode.finish = "done"
        return
    if episode.turns >= limits.max_turns:
        episode.finish = "turns"
        return
    stop = tokenizer.decode(episode.token_ids[-1:], skip_special_tokens=False)
    try:
        more = continuation_ids(tokenizer, reply.messages, stop, episode.tools)
    except ChatTemplateError as err:
        episode.finish, episode.error = "failed", f"the environment's messages cannot be rendered: {err}"
        return
    if episode.length + len(more) >= limits.total_tokens:  # no room for the answer and another turn
        episode.finish = "length"
        return
    episode._append(more, False)


def _share(episodes: Sequence[Episode], seconds: float) -> None:
    """Environment time of a batch of calls, split evenly over the episodes that made them."""
    for e in episodes:
        e.env_seconds += seconds / max(1, len(episodes))
