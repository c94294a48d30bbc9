"""How a step's prompt rows become completions, behind the one interface the batch source calls: a sampled turn
each (`SingleTurn`), or whole episodes with an environment (`posttrain.onpolicy.agent.AgentRollouts`, `rl.agent`).

    rollouts = SingleTurn(cfg.rl)                  # or AgentRollouts(cfg, tokenizer_dir, pool)
    rolled = rollouts.run(rows, params, samplers)  # Rolled: n completions a row, row-major; episodes (multi-turn)
    scores = rollouts.rewards(rolled, scores)      # an environment's rewards added (a single turn: as they are)

`samplers` is what the run's samplers offer a rollout (`Samplers`: the source implements it): a batch of prompts
generated at once (a single turn: one request, `n` samples a prompt, so an engine shares each prompt's prefix
among its samples), or turns for episodes that take them one at a time (`rollout.turns`). Everything above this
module (requests in flight, async, checkpoints, scoring, evaluation) is the same for both kinds.

A single turn is kept as its own kind, not run as an episode of one turn, because an episode samples each of a
prompt's `n` completions as its own request: on the JAX sampler that is the continuous-batching program rather
than the batched one, and on every sampler each sample's seed would change, so every existing run's draws would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from posttrain.config import RLConfig
from posttrain.onpolicy.prompts import render_prompt
from rewards.runner import RewardBatch
from rollout.episodes import Episode
from rollout.sampler import Completion, Prompt, SamplingParams
from rollout.turns import Turns


@dataclass
class Rolled:
    """A request's completions (`n` a row, row-major, as a sampler returns them) and, for multi-turn rollouts,
    the episodes they are (one per completion)."""

    completions: list[Completion]
    episodes: list[Episode] | None = None


class Samplers(Protocol):
    """What a rollout asks of the run's samplers."""

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of each prompt, prompt-major, now."""
        ...

    def turns(self, episodes: int) -> Turns:
        """The samplers as an episode runner's turns, for `episodes` episodes."""
        ...


class Rollouts(Protocol):
    def run(self, rows: Sequence[dict], params: SamplingParams, samplers: Samplers) -> Rolled: ...

    def rewards(self, rolled: Rolled, scores: RewardBatch | None) -> RewardBatch | None: ...


class SingleTurn:
    """One completion per sample: the row's prompt (`rl.prompt_template`, as a user turn with the chat template)
    in one request."""

    def __init__(self, rl: RLConfig):
        self.rl = rl

    def run(self, rows: Sequence[dict], params: SamplingParams, samplers: Samplers) -> Rolled:
        return Rolled(samplers.generate([render_prompt(r, self.rl) for r in rows], params))

    def rewards(self, rolled: Rolled, scores: RewardBatch | None) -> RewardBatch | None:
        return scores  # the reward functions' alone
