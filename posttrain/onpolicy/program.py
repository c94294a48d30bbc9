"""Agents written against an OpenAI client as a run's rollouts (`rl.agent.program`): the third kind of
`posttrain.onpolicy.rollouts.Rollouts`, beside `SingleTurn` and `AgentRollouts`.

    rollouts = ProgramRollouts(cfg, tokenizer_dir, pool)  # checks the program and the tool parser at start
    rolled = rollouts.run(rows, params, samplers)         # n episodes a row, each the program against the endpoint
    scores = rollouts.rewards(rolled, scores)             # the programs' rewards added to the functions' scores

Each step starts the OpenAI-compatible endpoint (`rollout.endpoint`) on the samplers' turns
(`Samplers.turns`: vLLM's engines, the JAX sampler's slots) and runs `rl.batch.num_generations` episodes a row,
each the program (`rollout.agent_program`) with a client whose base URL is that episode's, in the reward worker
pool. What the episode's calls sampled is its trajectory, token in / token out (`rollout.recording`), trained on
the model's tokens only; the row the program gets carries the formatted `rl.prompt_template` as `prompt`.

An episode that failed from outside the model is run again from its row with a fresh id and random stream, up to
`rl.agent.retries` times, each attempt counted by its cause: the program timed out (`agent/retries/timeout`), a call
could not reach the endpoint or the endpoint's sampler failed one of its calls (a 500: an engine failed;
`.../engine`, when the episode then failed, whatever the agent made of the error), its worker died or overran its
deadline (`.../worker`). What the failed attempt sampled is not trained on.

An agent that rewrote its history (a call that does not extend an earlier one: `rollout.recording`) made an episode
of several segments, each a trajectory: the one its last reply is in is the episode's (`Episode`), the others its
`earlier` ones, which GRPO trains as sequences of their own with the episode's advantage
(`posttrain.onpolicy.rl_batch.with_segments`); `agent/segments` counts them. A method that trains one trajectory
per episode (`SamplingMethod.trains_segments` False: PPO, online DPO, on-policy distillation) fails such an episode,
named.

Rewards: the program's return value (a number, or a dict of named numbers, summed), plus the reward functions'
score of the last reply when `reward.functions` are set; a program that returns None leaves the reward to the
functions. An episode fails (counted in `agent/failed`, its group dropped from the loss as a failed reward's is)
when the program raises, times out (`rl.agent.program_timeout_s`), returns something else, makes no call, or
returns None in a run without reward functions.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

from core.config_loader import ConfigError
from core.data import load_tokenizer
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.agent import check_tool_parser, with_episode_rewards
from posttrain.onpolicy.prompts import prompt_text
from posttrain.onpolicy.rollouts import Rolled, Samplers
from rewards.pool import Call, WorkerPool, shards_of
from rewards.runner import RewardBatch
from rollout.agent_program import check_program, command_argv
from rollout.endpoint import Endpoint
from rollout.episodes import Episode
from rollout.reasoning import ReasoningSplitter
from rollout.recording import Segment
from rollout.sampler import SamplingParams
from rollout.tool_parsing import ToolParsers

RUNNERS = {"program": "rollout.agent_program:ProgramRunner", "command": "rollout.agent_program:CommandRunner"}


class ProgramRollouts:
    def __init__(
        self, cfg: PostTrainConfig, tokenizer_dir: str, pool: WorkerPool, has_functions: bool, segments: bool = True
    ):
        """`segments`: the method trains an episode's several trajectories (`SamplingMethod.trains_segments`)."""
        agent = cfg.rl.agent
        assert agent is not None and agent.runs_agents
        self.cfg, self.agent, self.pool, self.has_functions = cfg, agent, pool, has_functions
        self.segments = segments
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.parsers = ToolParsers(agent.tool_parser, self.tokenizer)
        self.reasoning = None
        if agent.reasoning_parser is not None:
            try:
                self.reasoning = ReasoningSplitter(agent.reasoning_parser, self.tokenizer)
            except ValueError as err:
                raise ConfigError(f"rl.agent.reasoning_parser: {err}") from None
        kind, spec = ("program", agent.program) if agent.program is not None else ("command", agent.command)
        assert spec is not None
        self.runner = (RUNNERS[kind], {kind: spec, "timeout_s": agent.program_timeout_s})
        try:
            check_program(spec) if kind == "program" else command_argv(spec)
        except Exception as err:
            raise ConfigError(f"rl.agent.{kind}={spec!r}: {err}") from None
        check_tool_parser(self.parsers)

    def run(self, rows: Sequence[dict], params: SamplingParams, samplers: Samplers) -> Rolled:
        """`params.n` episodes a row, row-major, every episode's program running at once against the endpoint; an
        episode that failed from outside the model (`rollout.agent_program.lost`) runs again, afresh, up to
        `rl.agent.retries` times."""
        starts = [{**r, "prompt": prompt_text(r, self.cfg.rl)} for r in rows for _ in range(params.n)]
        turn = dataclasses.replace(params, n=1)
        endpoint = Endpoint(
            samplers.turns(len(starts)), self.tokenizer, self.parsers, turn, self.cfg.rollout.max_model_len,
            reasoning=self.reasoning,
        )  # fmt: skip
        endpoint.start()
        retried: list[list[str]] = [[] for _ in starts]
        done: dict[int, tuple[list[Segment], object, str | None]] = {}
        try:
            pending = list(range(len(starts)))
            while pending:
                outcomes = self._attempt(endpoint, starts, pending, retried)
                again = []
                for i, (segments, value, why, lost) in zip(pending, outcomes, strict=True):
                    if lost is not None and len(retried[i]) < self.agent.retries:
                        retried[i].append(lost)
                        again.append(i)
                    else:
                        done[i] = (segments, value, why)
                pending = again
        finally:
            endpoint.close()
        episodes = [self._episode(row, *done[i]) for i, row in enumerate(starts)]
        for e, causes in zip(episodes, retried, strict=True):
            e.retried = causes
        return Rolled([e.completion() for e in episodes], episodes)

    def _attempt(self, endpoint: Endpoint, starts: list[dict], which: list[int], retried: list[list[str]]) -> list:
        """One attempt at the episodes `which`, each on its own base URL: (its segments, value, why it failed, the
        cause where that was outside the model: `posttrain.onpolicy.agent.RETRY_CAUSES`) each, in order."""
        # unguessable: the endpoint has no authentication, only its loopback address and these ids
        ids = [f"episode-{i}-{secrets.token_hex(8)}" for i in which]
        # the request's seed (restored on resume) with the episode's index: a resumed run draws what the stopped
        # one drew; another attempt, another random stream (as for an environment's episodes)
        keys = [i + len(starts) * len(retried[i]) for i in which]
        urls = [endpoint.open(e, seed_key=k) for e, k in zip(ids, keys, strict=True)]
        shards = shards_of(len(which), self.pool.num_procs)
        runner, kwargs = self.runner
        rows = [starts[i] for i in which]
        calls = [Call("agent", runner, kwargs, "run", (rows[lo:hi], urls[lo:hi])) for lo, hi in shards]
        # each episode has its own timeout inside the worker; the worker's deadline is that and some slack
        results = self.pool.call(calls, self.agent.program_timeout_s + 30.0)
        outcomes: list[tuple[object, str | None, str | None]] = []
        for (lo, hi), result in zip(shards, results, strict=True):
            # a dead or overdue worker is retried; any other error of the runner is a bug to see, not retried
            died = result.error is not None and result.error.startswith(("timed out", "its worker died"))
            failed = [(None, f"its worker: {result.error}", "worker" if died else None)] * (hi - lo)
            outcomes.extend(result.value if result.error is None else failed)
        out = []
        for e, (value, why, lost) in zip(ids, outcomes, strict=True):
            if why is not None and lost is None and endpoint.served_errors(e):
                lost = "engine"  # whatever the agent made of it, the endpoint failed one of its calls (5xx)
            out.append((endpoint.finish(e), value, why, lost))
        return out

    def _episode(self, row: dict, segments: list[Segment], value: object, why: str | None) -> Episode:
        e = Episode(row)
        if segments:
            s = max(segments, key=lambda s: s.replied)  # the one the last reply went to: the episode's
            e.prompt_ids, e.token_ids, e.sampled, e.logprobs = s.prompt_ids, s.token_ids, s.sampled, s.logprobs
            e.final_text = s.final_text
            e.policy_version = min(t.policy_version for t in segments)  # its oldest: what staleness is checked on
            e.turns = s.replied  # the episode's calls, in every segment
            e.tool_calls = sum(len(m.called) for m in s.marks)
            e.earlier = [t.completion() for t in segments if t is not s]
            e.finish = "length" if s.cut else "done"
        if why is None and not segments:
            why = "the program made no call to the model"
        elif why is None and e.earlier and not self.segments:
            why = (
                f"its calls formed {len(segments)} segments (the agent rewrote its history), and the run's method "
                "trains one trajectory per episode (GRPO trains them all)"
            )
        elif why is None and value is None and not self.has_functions:
            why = "the program returned None and the run has no reward.functions to score the episode"
        if why is not None:
            e.finish, e.error, e.earlier = "failed", why, []  # what a failed episode sampled trains nothing
        elif value is not None:
            e.rewards = [float(sum(value.values())) if isinstance(value, dict) else float(value)]  # type: ignore[arg-type]
        return e

    def rewards(self, rolled: Rolled, scored: RewardBatch | None) -> RewardBatch:
        """The programs' rewards added to the functions' scores (or alone)."""
        episodes = rolled.episodes
        assert episodes is not None  # `run`'s
        return with_episode_rewards(scored, "agent", episodes, [sum(e.rewards) for e in episodes])
