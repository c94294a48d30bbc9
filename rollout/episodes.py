"""Multi-turn episodes, token in / token out: the model and an environment take turns until the episode ends.

    turns = SlotTurns(jax_sampler, slots=32)  # or EngineTurns(group, push): each turn its own vLLM request
    episodes = run_episodes(turns, env, tokenizer, rows, limits, params, ToolParsers("hermes", tokenizer))
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

At most `concurrency` episodes run at once (`rl.agent.max_concurrency`); the others start as running ones end.
How their turns meet the sampler is `turns`' business (`rollout.turns`): each episode on its own, its next turn
sent as soon as the environment answered, on vLLM's engines (`EngineTurns`) or the JAX sampler's slots
(`rollout.jax_engine.SlotTurns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core.chat import chat_prompt_ids, continuation_ids
from core.chat_template import ChatTemplateError
from rollout.environment import EnvFailure, EnvironmentRunner, EnvReply, EnvStart
from rollout.sampler import Completion, SamplingParams
from rollout.tool_parsing import ParsedTurn, ToolParsers
from rollout.turns import TurnRequest, Turns, turn_seed

Finish = Literal["done", "length", "turns", "failed"]


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
    retried: list[str] = field(default_factory=list)  # each earlier attempt's cause (agent.RETRY_CAUSES)
    environment: str | None = None  # the environment of a mapping its row chose (`rollout.routed_env`)
    # The episode's other trajectories, in the order they started (this one is the segment its last reply went to):
    # an agent that rewrote its history through the endpoint (`rollout.recording`: each segment a trajectory). A
    # method that trains them gives each the episode's advantage (`posttrain.onpolicy.rl_batch.with_segments`).
    earlier: list[Completion] = field(default_factory=list)

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

    def record(self) -> dict:
        """What a checkpoint keeps of a finished episode, as JSON values (`from_record` rebuilds it): everything but
        the environment's state, which ends with the episode."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "state"}
        out["earlier"] = [c.record() for c in self.earlier]
        return out

    @classmethod
    def from_record(cls, record: dict) -> Episode:
        return cls(**{**record, "earlier": [Completion.from_record(c) for c in record.get("earlier", [])]})

    def _append(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids.extend(int(t) for t in ids)
        self.sampled.extend([sampled] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def run_episodes(
    turns: Turns,
    env: EnvironmentRunner,
    tokenizer: Any,
    rows: Sequence[dict],
    limits: EpisodeLimits,
    params: SamplingParams,
    parsers: ToolParsers,
    concurrency: int | None = None,
    retries: int = 0,
) -> list[Episode]:
    """Run one episode per row to its end, at most `concurrency` of them at a time (None: all). `turns` samples the
    turns (`rollout.turns`); `params` is the per-turn sampling, its seed mixed with each episode's index, attempt
    and turn so that no two turns share a random stream. An episode whose environment failed, not its model (its
    reset failed, or a step timed out or killed its worker), is started again from its row, with a fresh
    environment state and seeds, up to `retries` times; each attempt's cause is kept (`Episode.retried`)."""
    episodes = [Episode(dict(r)) for r in rows]
    t0 = time.perf_counter()
    for i, start in enumerate(env.reset(rows)):
        _begin(episodes[i], start, tokenizer, limits)
        # A reset that failed (the model has not acted yet): again at once, up to `retries` times. A prompt the
        # template cannot render or that does not fit fails the same way every time: not retried.
        while isinstance(start, EnvFailure) and len(episodes[i].retried) < retries:
            episodes[i] = _again(episodes[i], "reset")
            start = env.reset([episodes[i].row])[0]
            _begin(episodes[i], start, tokenizer, limits)
    _share(episodes, time.perf_counter() - t0)
    waiting = deque(i for i, e in enumerate(episodes) if not e.done)
    running: set[int] = set()

    def room(e: Episode) -> int:  # the tokens its next turn may take (unchanged while the turn is in flight)
        return min(limits.turn_tokens, limits.total_tokens - e.length)

    def next_turn(i: int) -> TurnRequest:
        e = episodes[i]
        key = i + len(episodes) * len(e.retried)  # another attempt, another stream
        turn = dataclasses.replace(
            params, n=1, max_tokens=room(e), seed=turn_seed(params.seed, key, e.turns), logprobs=True
        )
        return TurnRequest(i, e.prompt_ids + e.token_ids, turn)

    try:
        while waiting or running:
            while waiting and (concurrency is None or len(running) < concurrency):
                running.add(i := waiting.popleft())
                turns.put([next_turn(i)])
            stepping: list[tuple[int, ParsedTurn]] = []
            taken = turns.take()
            if not taken:  # every running episode has a turn in flight: one must come back
                raise RuntimeError(f"the turns of {len(running)} running episodes were lost")
            for i, out in taken:
                episode = episodes[i]
                limit = room(episode)
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
                    running.discard(i)
                    continue
                stepping.append((i, parsers.for_tools(episode.tools).parse(text)))
            if not stepping:
                continue
            t1 = time.perf_counter()
            replies = env.step([episodes[i].state for i, _ in stepping], [p for _, p in stepping])
            _share([episodes[i] for i, _ in stepping], time.perf_counter() - t1)
            for (i, parsed), reply in zip(stepping, replies, strict=True):
                _take(episodes[i], parsed, reply, tokenizer, limits)
                # A step that timed out or killed its worker failed for the environment, not for what the model wrote
                # (a step that raised on the model's turn may well be the model's doing: not retried): again, afresh.
                failure: EnvStart | EnvReply | EnvFailure = reply
                cause = "lost" if isinstance(failure, EnvFailure) and failure.state_lost else "step"
                while isinstance(failure, EnvFailure) and (failure.infrastructure or cause == "reset"):
                    if len(episodes[i].retried) >= retries:
                        break
                    episodes[i] = _again(episodes[i], cause)
                    failure = env.reset([episodes[i].row])[0]
                    _begin(episodes[i], failure, tokenizer, limits)
                    cause = "reset"
                if episodes[i].done:
                    running.discard(i)
                else:
                    turns.put([next_turn(i)])
    except BaseException:  # what the workers keep is let go, best effort: the error that stopped the loop goes on
        with contextlib.suppress(Exception):
            _release(env, episodes)
        raise
    _release(env, episodes)
    return episodes


def _release(env: EnvironmentRunner, episodes: Sequence[Episode]) -> None:
    """What the workers keep for episodes the environment did not end (cut, out of turns, failed, stopped)."""
    env.release([e.state for e in episodes if e.finish != "done" and e.state is not None])


def _begin(episode: Episode, start: EnvStart | EnvFailure, tokenizer: Any, limits: EpisodeLimits) -> None:
    """An episode's start from its environment's reset: its tools, state and prompt tokens, or why it failed."""
    if isinstance(start, EnvFailure):
        episode.finish, episode.error = "failed", start.message
        return
    episode.tools, episode.state = start.tools, start.state
    try:
        episode.prompt_ids = chat_prompt_ids(tokenizer, start.messages, start.tools)
    except ChatTemplateError as err:
        episode.finish, episode.error = "failed", f"the start of the episode cannot be rendered: {err}"
        return
    if episode.length >= limits.total_tokens:  # it never starts: it holds no token (none would fit a trainer's row)
        episode.finish = "failed"
        episode.error = f"the prompt takes {episode.length} tokens of rollout.max_model_len={limits.total_tokens}"
        episode.prompt_ids = []


def _again(failed: Episode, cause: str) -> Episode:
    """A fresh attempt at `failed`'s row, the causes of the attempts before it kept."""
    return Episode(failed.row, retried=[*failed.retried, cause])


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
        more = continuation_ids(tokenizer, reply.messages, stop, episode.tools, [c.name for c in parsed.tool_calls])
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
