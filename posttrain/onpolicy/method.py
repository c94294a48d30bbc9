"""A method that trains on its own samples: a `core.method.Method` that also says what it makes of them.

    class GRPOMethod(SamplingMethod[RLBatch]):          # posttrain.grpo
        def from_samples(self, cfg, scored, ctx): ...  # scored completions -> StepData (the trainer's batch)
    summary = fit(cfg, GRPO)                            # posttrain.fit: the on-policy run, with either sampler

The on-policy run (`posttrain.onpolicy.run.build_sampler_run`) samples, scores and syncs weights for every such method;
the method says how long a packed trainer row is (`row_length`), what it makes of a step's scored completions
(`from_samples`: its batch, any `core.batch.TrainBatch`, and its metrics; `SampleContext.more` draws and scores
another request, for DAPO's refill) and which curves the run draws (`plots`). What trains and how (the loss,
frozen models, the updates) is the `Method`'s, run by the trainer's `core.method_learner.MethodLearner`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from core.loop import Plot
from core.method import Method
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.step import Scored, StepData

B = TypeVar("B")

REWARD_PLOT = Plot(("reward/mean", "accuracy", "eval/pass@1"), "reward.png", "reward / accuracy")


@dataclass
class SampleContext:
    """What a method makes its batch with, besides the scored completions."""

    step: int  # the step being trained (1-based)
    row_len: int  # tokens a packed trainer row holds (`SamplingMethod.row_length`)
    row_multiple: int  # the trainer's data-parallel size: packed row counts are a multiple of it
    tokenizer: Any  # the run's, read once
    more: Callable[[], Scored]  # another request of the prompt stream's next prompts, sampled and scored


class SamplingMethod(Method[B]):
    """A method whose batches come from the samplers (module docstring)."""

    # Whether it trains every trajectory of an episode whose agent rewrote its history through the endpoint
    # (`Episode.earlier`, each with the episode's advantage); a method that does not fails such an episode, counted.
    trains_segments: bool = False

    def row_length(self, cfg: PostTrainConfig) -> int:
        """Tokens per packed trainer row: `rl.batch.pack_length`, else `rollout.max_model_len` (a prompt and its
        completions fit in it, the prompt once)."""
        return cfg.rl.batch.pack_length or cfg.rollout.max_model_len

    def from_samples(self, cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
        raise NotImplementedError(f"{self.name} makes no batch of samples")

    def plots(self, cfg: PostTrainConfig) -> tuple[Plot, ...]:
        """The curves the run draws at its end."""
        return (REWARD_PLOT,)
