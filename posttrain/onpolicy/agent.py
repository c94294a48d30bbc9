"""Multi-turn rollouts in the on-policy run (`rl.agent`): episodes in place of single completions, for any method.

    agent = AgentRollouts(cfg, tokenizer_dir, pool)  # checks the environment, parser and template at start
    rolled = agent.run(rows, params, samplers)       # episodes, their turns from samplers.turns (EngineTurns on vLLM)
    scores = agent.rewards(rolled, scores)           # the environment's rewards added to the functions'

One kind of `posttrain.onpolicy.rollouts.Rollouts` (the other: `SingleTurn`).

Each row is `rl.batch.num_generations` episodes (`rollout.episodes.run_episodes`), each a `Completion` whose
environment tokens are not sampled (`Completion.sampled`), so every method's batch trains on the model's tokens
only. The row the environment gets carries the formatted `rl.prompt_template` as `prompt`.

Rewards: an episode's reward is the reward functions' score of its final answer (when `reward.functions` are
set) plus the environment's per-turn rewards, summed with `rl.agent.discount` (as the `environment` reward in
the metrics); an episode whose environment failed counts as a failed reward (its group is dropped).

Checked at start, before Ray or an engine starts: the environment imports and builds, vLLM has the tool parser,
and the chat template renders a tool reply after an assistant turn (a family whose template cannot is named).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.chat import continuation_ids
from core.chat_template import ChatTemplateError, turn_stop_ids, written_turn_ends
from core.config_loader import ConfigError
from core.data import load_tokenizer
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.prompts import prompt_text
from posttrain.onpolicy.rollouts import Rolled, Samplers
from posttrain.rl_config import AgentConfig
from rewards.pool import WorkerPool
from rewards.runner import RewardBatch
from rollout.environment import EnvironmentRunner
from rollout.episodes import Episode, EpisodeLimits, run_episodes
from rollout.routed_env import routing_column
from rollout.sampler import SamplingParams
from rollout.tool_parsing import ToolParsers


class AgentRollouts:
    def __init__(self, cfg: PostTrainConfig, tokenizer_dir: str, pool: WorkerPool):
        agent = cfg.rl.agent
        assert agent is not None and agent.environment is not None  # an environment's episodes (not a program's)
        self.cfg, self.agent = cfg, agent
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.env = EnvironmentRunner(agent.environment, agent.environment_kwargs, pool, agent.env_timeout_s)
        self.limits = EpisodeLimits(agent.max_turns, cfg.rollout.max_tokens, cfg.rollout.max_model_len)
        self.parsers = ToolParsers(agent.tool_parser, self.tokenizer)
        self.check()

    def check(self) -> None:
        where = f"rl.agent.environment={self.agent.environment!r}"
        try:
            self.env.check()
        except Exception as err:
            raise ConfigError(f"{where} cannot be built: {type(err).__name__}: {err}") from None
        check_tool_parser(self.parsers)
        # A turn stops on one of the template's turn ends (`core.chat.turn_stop_ids`): an environment's reply must
        # continue after each (a turn of tool calls or a reply). A base model's EOS (`<|endoftext|>` beside
        # ChatML's `<|im_end|>`) is no turn end of the template: an episode whose turn ends there cannot go on,
        # and ends failed (counted in agent/failed).
        result = [{"role": "tool", "name": "probe", "content": "42"}]
        stops = self.tokenizer.convert_ids_to_tokens(list(turn_stop_ids(self.tokenizer)))
        written = written_turn_ends(self.tokenizer)
        failed = {}
        for stop in [s for s in stops if s in written] or stops:
            try:
                continuation_ids(self.tokenizer, result, stop, called=["probe"])
            except ChatTemplateError as err:
                failed[stop] = str(err)
        if failed:
            template = getattr(self.tokenizer, "name_or_path", "the tokenizer")
            reasons = "; ".join(f"{stop!r}: {why}" for stop, why in failed.items())
            raise ConfigError(
                f"rl.agent: the chat template of {template} cannot continue with a tool reply after "
                f"a turn that ends on {reasons}"
            )

    def run(self, rows: Sequence[dict], params: SamplingParams, samplers: Samplers) -> Rolled:
        """`params.n` episodes a row, row-major (as a sampler returns `n` completions a prompt), their turns sampled
        by `samplers.turns`, at most `rl.agent.max_concurrency` at a time."""
        starts = [{**r, "prompt": prompt_text(r, self.cfg.rl)} for r in rows for _ in range(params.n)]
        turns = samplers.turns(len(starts))
        episodes = run_episodes(
            turns, self.env, self.tokenizer, starts, self.limits, params, self.parsers, self.agent.max_concurrency,
            retries=self.agent.retries,
        )  # fmt: skip
        for e in episodes:
            e.environment = environment_of(e.row, self.agent)
        return Rolled([e.completion() for e in episodes], episodes)

    def rewards(self, rolled: Rolled, scored: RewardBatch | None) -> RewardBatch:
        """The environment's discounted per-turn rewards added to the functions' scores (or alone)."""
        episodes = rolled.episodes
        assert episodes is not None  # `run`'s
        gamma = self.agent.discount
        values = [sum(r * gamma**t for t, r in enumerate(e.rewards)) for e in episodes]
        return with_episode_rewards(scored, "environment", episodes, values)


def environment_of(row: dict, agent: AgentConfig) -> str | None:
    """The environment a row chose in a mapping of environments (its routing column, `environment_kwargs.column`);
    None with one environment."""
    name = row.get(routing_column(agent.environment_kwargs))
    return None if not isinstance(agent.environment, dict) or name is None else str(name)


def check_tool_parser(parsers: ToolParsers) -> None:
    """`rl.agent.tool_parser` is one vLLM has (refused at start, with the list, where it is not)."""
    try:
        parsers.for_tools([])
    except ValueError as err:
        raise ConfigError(f"rl.agent.tool_parser: {err}") from None


def with_episode_rewards(
    scored: RewardBatch | None, name: str, episodes: Sequence[Episode], values: Sequence[float]
) -> RewardBatch:
    """`scored` (the reward functions', or none) with the episodes' own rewards added as `name`; a failed episode
    fails its item (its group is dropped), its first error kept."""
    failed = np.array([e.finish == "failed" for e in episodes])
    errors = [e.error for e in episodes if e.error]
    base = scored if scored is not None else RewardBatch.empty(len(episodes))
    return base.plus(name, np.asarray(values, np.float32), failed, errors[:1])


# Why an attempt at an episode was started again: its environment's reset failed, a step timed out or killed its
# worker, the worker that kept its state was replaced (`rollout.environment.StateLost`); an agent program's or
# command's timeout, the endpoint failing one of its calls (an engine), its worker dying.
RETRY_CAUSES = ("reset", "step", "lost", "timeout", "engine", "worker")


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Turns, tool calls and errors per episode, truncated and failed shares, environment time, the tokens each
    source wrote (the model's, the environment's) and the trajectories (segments) per episode; and, in a mapping of
    environments, turns, failures and environment reward per environment (`Episode.environment`)."""
    out = _episode_metrics(episodes)
    for name in sorted({e.environment for e in episodes if e.environment is not None}):
        mine = [e for e in episodes if e.environment == name]
        out[f"agent/{name}/turns"] = sum(e.turns for e in mine) / len(mine)
        out[f"agent/{name}/failed"] = sum(e.finish == "failed" for e in mine) / len(mine)
        out[f"agent/{name}/reward"] = sum(sum(e.rewards) for e in mine) / len(mine)
    return out


def _episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    n = max(1, len(episodes))
    # an episode's trajectories: its earlier segments (`Episode.earlier`), then its own
    flags = [c.sampled or () for e in episodes for c in e.earlier] + [e.sampled for e in episodes]
    model = sum(sum(f) for f in flags)
    tokens = sum(len(f) for f in flags)
    return {
        "agent/turns": sum(e.turns for e in episodes) / n,
        "agent/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "agent/tool_errors": sum(e.tool_errors for e in episodes) / n,
        "agent/truncated": sum(e.finish in ("length", "turns") for e in episodes) / n,
        "agent/failed": sum(e.finish == "failed" for e in episodes) / n,
        "agent/env_s": sum(e.env_seconds for e in episodes),
        "agent/model_tokens": model / n,
        "agent/env_tokens": (tokens - model) / n,
        "agent/segments": len(flags) / n,  # trajectories per episode (an agent that rewrote its history)
        # attempts started again because they failed outside the model (rl.agent.retries), per trajectory, by cause
        **{f"agent/retries/{c}": sum(e.retried.count(c) for e in episodes) / n for c in RETRY_CAUSES},
    }
