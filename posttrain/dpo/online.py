"""Online DPO: pairs built from the policy's own samples, graded by the reward functions, trained on at once.

    summary = fit(cfg, ONLINE_DPO)      # python -m recipes.dpo CONFIG.yml dpo.online=true

A method of the on-policy run (`posttrain.onpolicy.run.build_sampler_run`: vLLM samplers on Ray or the JAX sampler,
reward functions, weight sync after every update, evaluation, checkpoints and exact resume): the samplers draw
`rl.batch.num_generations` (k >= 2) completions for each of `rl.batch.prompts_per_step` prompts, the reward
functions score them, and each prompt gives one pair: its best completion as chosen, its worst as rejected (the
first of equals). With `dpo.missing_eos_penalty` (TRL's; default None, as TRL's: off) a completion cut at
`rollout.max_tokens` without its end-of-sequence token has that much subtracted from its reward first, so a
truncated sample is not preferred for its length. A prompt whose completions all score the same carries no
preference and gives none (`pairs/ties`), nor does one where a reward function failed on any completion
(`pairs/failed`), nor one whose best and worst completions are the same tokens (`pairs/identical`). The pairs,
each prompt once with its two completions as branches, train one DPO update
(`posttrain.dpo.objective.preference_objective(cfg.dpo)`, every loss type) against the starting policy, frozen,
as the reference; log-probs are at temperature 1, the model's own distribution. A step with no pair makes no
update.

A pair's row holds its prompt and both completions: up to `rollout.max_model_len` (the prompt and one
completion, as vLLM bounds them) plus another `rollout.max_tokens`, so rows are that long (`row_length`) and
no pair the samplers can produce fails to fit.
"""

from __future__ import annotations

import numpy as np

from core.config_loader import ConfigError
from core.learner import Learner
from core.method import Attach, TrainStats
from core.train import LossFn, Update
from posttrain.config import PostTrainConfig
from posttrain.dpo.objective import live_reference, preference_objective
from posttrain.dpo.pairs import Pair, PairBatch, build_pair_batch
from posttrain.onpolicy.checks import check_graded_groups
from posttrain.onpolicy.method import SampleContext, SamplingMethod
from posttrain.onpolicy.policy_gradient import completion_tokens
from posttrain.onpolicy.step import Scored, StepData
from rollout.sampler import Completion


def best_worst_pairs(
    completions: list[Completion], rewards: np.ndarray, k: int, missing_eos_penalty: float | None = None
) -> tuple[list[Pair], dict[str, int]]:
    """(one pair per prompt whose k completions' rewards differ: the first best as chosen, the first worst as
    rejected; counts of the prompts left out: `ties`, `failed` (a NaN reward), `identical` (the best and the worst
    are the same tokens)). `Pair.row` is the prompt's index in the batch. With `missing_eos_penalty`, a completion
    cut at the length limit has it subtracted from its reward first."""
    pairs: list[Pair] = []
    left_out = {"ties": 0, "failed": 0, "identical": 0}
    for i in range(len(completions) // k):
        group = completions[i * k : (i + 1) * k]
        scores = np.asarray(rewards[i * k : (i + 1) * k], np.float64)
        if not np.isfinite(scores).all():
            left_out["failed"] += 1
            continue
        if missing_eos_penalty is not None:
            scores = scores - missing_eos_penalty * np.array([c.finish_reason == "length" for c in group], float)
        best, worst = int(np.argmax(scores)), int(np.argmin(scores))
        if scores[best] == scores[worst]:
            left_out["ties"] += 1
            continue
        chosen, rejected = group[best], group[worst]
        if list(chosen.token_ids) == list(rejected.token_ids):
            left_out["identical"] += 1
            continue
        pairs.append(
            Pair(
                i,
                tuple(chosen.prompt_ids),
                tuple(chosen.token_ids),
                tuple(rejected.token_ids),
                None if chosen.sampled is None else tuple(chosen.sampled),
                None if rejected.sampled is None else tuple(rejected.sampled),
            )
        )
    return pairs, left_out


class OnlineDPOMethod(SamplingMethod[PairBatch]):
    """Best / worst pairs of each prompt's samples, one DPO update a step against the frozen starting policy (none
    for reference-free losses)."""

    name = "online DPO"

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def row_length(self, cfg: PostTrainConfig) -> int:
        """A pair's prompt and both completions: `rollout.max_model_len + rollout.max_tokens` (or
        `rl.batch.pack_length`, checked to be at least that)."""
        return cfg.rl.batch.pack_length or pair_length(cfg)

    def loss(self, cfg: PostTrainConfig) -> LossFn:
        return preference_objective(cfg.dpo)

    def attach(self, cfg: PostTrainConfig, learner: Learner) -> Attach[PairBatch]:
        return live_reference(cfg.dpo, learner)

    def report(self, cfg: PostTrainConfig, updates: list[Update], attached: dict[str, float]) -> TrainStats:
        out = updates[-1].metrics()
        # the share of pairs whose chosen completion gets the higher implicit reward
        return TrainStats(out, f"pref acc {out['rewards/accuracies']:.3f}")

    def from_samples(self, cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
        assert scored.rewards is not None  # online DPO has reward functions (checked)
        k = cfg.rl.batch.num_generations
        pairs, left_out = best_worst_pairs(scored.completions, scored.rewards.total, k, cfg.dpo.missing_eos_penalty)
        metrics = {"pairs": float(len(pairs)), **{f"pairs/{k}": float(v) for k, v in left_out.items()}}
        line = f"pairs {len(pairs)} (ties {left_out['ties']})"
        batch = None
        if pairs:
            batch = build_pair_batch(
                pairs,
                slots=cfg.rl.batch.prompts_per_step,
                row_len=ctx.row_len,
                groups=cfg.train.micro_batches,
                pack=cfg.rl.batch.pack_sequences,
                row_multiple=ctx.row_multiple,
            )
        return StepData(batch, scored, metrics, line)


ONLINE_DPO = OnlineDPOMethod()


def pair_length(cfg: PostTrainConfig) -> int:
    """The most tokens a sampled pair holds: a prompt and one completion (<= rollout.max_model_len, vLLM's bound)
    and a second completion (<= rollout.max_tokens; a whole trajectory's with `rl.agent`)."""
    return cfg.rollout.max_model_len + completion_tokens(cfg)


def check_config(cfg: PostTrainConfig) -> None:
    b = cfg.rl.batch
    check_graded_groups(cfg, "online DPO picks the best and worst of its samples: it")
    if cfg.rl.router_replay != "off":
        raise ConfigError("rl.router_replay=replay is built for GRPO; online DPO trains with its own routing")
    if b.dynamic_sampling or b.num_iterations != 1 or b.mini_batches != 1:
        raise ConfigError(
            "online DPO makes one update per step: rl.batch.dynamic_sampling=false, num_iterations=1, "
            f"mini_batches=1 (got {b.dynamic_sampling}, {b.num_iterations}, {b.mini_batches})"
        )
    if b.prompts_per_step % cfg.train.micro_batches:
        raise ConfigError(
            f"rl.batch.prompts_per_step={b.prompts_per_step} is not divisible by train.micro_batches="
            f"{cfg.train.micro_batches}"
        )
    if b.pack_length and b.pack_length < pair_length(cfg):
        raise ConfigError(
            f"rl.batch.pack_length ({b.pack_length}) cannot hold a sampled pair: a prompt and its completion take up "
            f"to rollout.max_model_len ({cfg.rollout.max_model_len}) and the second completion up to "
            f"{completion_tokens(cfg)} tokens; set it to at least {pair_length(cfg)} or 0"
        )
