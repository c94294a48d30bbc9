"""The policy-gradient update every sampling method trains with: its objective, its statistics, its method.

    class GRPO(PolicyGradient): ...     # posttrain.grpo: where the batch comes from (group advantages)
    stats = MethodLearner(cfg, GRPO, model, mesh).train(batch)   # pi_old / reference passes, the clipped updates

The batch (`RLBatch`, `build_rl_batch`) is `posttrain.onpolicy.rl_batch`'s.

The update (`PolicyGradient`, a `core.method.Method`): one step is `rl.batch.num_iterations` passes over the batch,
each cut into `rl.batch.mini_batches` optimizer updates (each accumulated over `train.micro_batches`), with the loss
`policy_objective` (`posttrain.losses.policy`: clipping, TIS, the KL term). The reference (`rl.loss.beta` > 0) is
a `posttrain.frozen.FrozenModel`, a frozen copy of the starting policy; pi_old's log-probs come from the update's
own forward pass when the step has one update (held constant by a stop-gradient: no extra pass), else from one
pass up front. Its statistics come back typed (`PolicyStats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.batch import with_groups
from core.learner import Learner
from core.method import Attach, TrainStats
from core.models.moe import check_routes
from core.router_loss import pooled_router_metrics
from core.sums import combine, maximum, summed
from core.targets import target_logprobs
from core.train import LossOutput, Update
from posttrain.advantages import Advantages, AdvantageSettings, group_advantages, normalized_advantages
from posttrain.config import PostTrainConfig
from posttrain.frozen import FrozenModel, LogprobPass, grouped_logprobs
from posttrain.losses.correction import CorrectionSettings
from posttrain.losses.policy import PolicyLossSettings, PolicyTerms, policy_loss
from posttrain.onpolicy.method import SamplingMethod
from posttrain.onpolicy.rl_batch import RLBatch, build_rl_batch, placeholder, with_segments
from rewards.runner import RewardBatch, function_names
from rollout.sampler import Completion

# ------------------------------------------------------------------ the objective


def completion_tokens(cfg: PostTrainConfig) -> int:
    """The most tokens a completion holds: `rollout.max_tokens`; in multi-turn rollouts (`rl.agent`) every token
    after the prompt, the model's and the environment's (`rollout.max_model_len` bounds them)."""
    return cfg.rollout.max_model_len if cfg.rl.agent is not None else cfg.rollout.max_tokens


def loss_settings(cfg: PostTrainConfig) -> PolicyLossSettings:
    loss, correction = cfg.rl.loss, cfg.rl.rollout_correction
    return PolicyLossSettings(
        algorithm=cfg.rl.algorithm,
        type=loss.type,
        epsilon=loss.epsilon,
        epsilon_high=loss.epsilon_high,
        dual_clip=loss.dual_clip,
        cispo_cap=loss.cispo_cap,
        sapo_tau_pos=loss.sapo_tau_pos,
        sapo_tau_neg=loss.sapo_tau_neg,
        dppo_delta=loss.dppo_delta,
        dppo_cap=loss.dppo_cap,
        correction=CorrectionSettings(correction.mode, correction.lo, correction.hi),  # type: ignore[arg-type]
        entropy_coef=loss.entropy_coef,
        entropy_adaptive=loss.entropy_target is not None,
        beta=loss.beta,
        kl_estimator=loss.kl_estimator,
        loss_agg=loss.loss_agg,
        max_tokens=completion_tokens(cfg),
        sequences=episodes_per_micro_batch(cfg),
    )


def episodes_per_micro_batch(cfg: PostTrainConfig) -> int:
    """The episodes (completions) of a step's micro-batch, whatever segments and padding it holds besides."""
    b = cfg.rl.batch
    return b.prompts_per_step * b.num_generations // (b.mini_batches * cfg.train.micro_batches)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class UpdateSums:
    """What one update's loss sums besides the loss itself (a `core.sums` record, combined over its micro-batches):
    the policy terms, the entropy, and the sampler/trainer mismatch (|gap| of the log-probs over the completion
    tokens, its largest value, and the k1 estimate of KL(sampler || trainer) summed per sequence: tokens were
    drawn by the sampler)."""

    terms: PolicyTerms
    entropy: Any = summed()
    mismatch_gap: Any = summed()
    mismatch_tokens: Any = summed()
    mismatch_seq_kl: Any = summed()
    mismatch_sequences: Any = summed()
    mismatch_gap_max: Any = maximum()


def mismatch_sums(trainer_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    gap = jnp.abs(trainer_logp - sampler_logp) * mask
    rows = mask.sum(axis=-1) > 0
    return {
        "mismatch_gap": gap.sum(),
        "mismatch_tokens": mask.sum(),
        "mismatch_gap_max": gap.max(),
        "mismatch_seq_kl": ((sampler_logp - trainer_logp) * mask).sum(),
        "mismatch_sequences": rows.sum().astype(jnp.float32),
    }


def policy_objective(settings: PolicyLossSettings, temperature: float = 1.0):
    """loss_fn(model, RLBatch, rng) -> LossOutput for `core.train.make_train_step`. Log-probs are taken at the
    sampling temperature, as the sampler drew them."""

    def loss_fn(model, batch: RLBatch, rng: jax.Array | None) -> LossOutput:
        logp, entropy = target_logprobs(model, batch.packed, temperature, rng=rng, routed=True)  # the sampled model
        assert entropy is not None  # asked for (the default)
        mask = batch.loss_mask.astype(jnp.float32)
        # The first update of a batch is at pi_old: its log-probs are this pass's, held constant.
        old_logp = batch.old_logp if batch.old_logp is not None else jax.lax.stop_gradient(logp)
        loss_sum, denominator, terms = policy_loss(
            logp,
            old_logp,
            batch.advantages,
            mask,
            settings,
            sampler_logp=batch.sampler_logp,
            ref_logp=batch.ref_logp,
            kl_mask=batch.kl_mask,
            entropy=entropy,
            # every slot holds it (padding 0, and the coefficient is >= 0)
            entropy_coef=None if batch.entropy_coef is None else jnp.max(batch.entropy_coef),
        )
        sums = UpdateSums(
            terms,
            entropy=(jax.lax.stop_gradient(entropy) * mask).sum(),
            **mismatch_sums(old_logp, batch.sampler_logp, batch.packed.target_mask.astype(jnp.float32)),
        )
        return LossOutput(loss_sum, denominator, sums)

    return loss_fn


# ------------------------------------------------------------------ metrics


@dataclass(frozen=True)
class PolicyStats:
    """One step's statistics from its updates: loss, gradient norm and learning rate averaged over the updates;
    token statistics as ratios of the summed sums; the sampler mismatch over the first pass (pi_old's log-probs,
    every completion token once). `kl` and `correction` are None where their term is off."""

    loss: float
    grad_norm: float
    learning_rate: float
    clip_fraction: float
    entropy: float
    kl: float | None
    correction: dict[str, float] | None  # the rollout correction's metrics (`correction_metrics`)
    entropy_coef: float | None  # the entropy bonus's coefficient (None: no bonus)
    mismatch_gap_mean: float
    mismatch_gap_max: float
    mismatch_seq_kl: float
    ratio: tuple[float, float, float]  # the objective's ratio pi_theta / pi_old over the counted tokens: mean, min, max

    @classmethod
    def summarise(cls, updates: list[Update], passes: int, settings: PolicyLossSettings) -> PolicyStats:
        every = reduce(combine, [u.sums for u in updates])
        first: UpdateSums = reduce(combine, [u.sums for u in updates[: len(updates) // passes]])
        ratio = lambda a, b: float(a) / max(float(b), 1e-9)
        tokens = every.terms.completion_tokens
        return cls(
            loss=float(np.mean([u.loss for u in updates])),
            grad_norm=float(np.mean([u.grad_norm for u in updates])),
            learning_rate=float(np.mean([u.learning_rate or 0.0 for u in updates])),
            clip_fraction=ratio(every.terms.clipped_tokens, tokens),
            entropy=ratio(every.entropy, tokens),
            kl=ratio(every.terms.kl, every.terms.kl_tokens) if settings.beta > 0 else None,
            correction=correction_metrics(every.terms) if settings.correction.mode != "off" else None,
            entropy_coef=(settings.entropy_coef or None) if not settings.entropy_adaptive else None,
            mismatch_gap_mean=ratio(first.mismatch_gap, first.mismatch_tokens),
            mismatch_gap_max=max(float(first.mismatch_gap_max), 0.0),
            mismatch_seq_kl=ratio(first.mismatch_seq_kl, first.mismatch_sequences),
            ratio=(
                ratio(every.terms.ratio, tokens) if float(tokens) else 1.0,
                -float(every.terms.ratio_min_neg) if float(tokens) else 1.0,
                float(every.terms.ratio_max) if float(tokens) else 1.0,
            ),
        )

    def metrics(self) -> dict[str, float]:
        """The names the run logs them under."""
        out = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "learning_rate": self.learning_rate,
            "clip_fraction": self.clip_fraction,
            "entropy": self.entropy,
            "mismatch/logp_gap_mean": self.mismatch_gap_mean,
            "mismatch/logp_gap_max": self.mismatch_gap_max,
            "mismatch/seq_kl": self.mismatch_seq_kl,
            "ratio/mean": self.ratio[0],
            "ratio/min": self.ratio[1],
            "ratio/max": self.ratio[2],
        }
        if self.kl is not None:
            out["kl"] = self.kl
        if self.correction is not None:
            out.update(self.correction)
        if self.entropy_coef is not None:
            out["entropy_coef"] = self.entropy_coef
        return out


def correction_metrics(terms: PolicyTerms) -> dict[str, float]:
    """The rollout correction over a step's updates: its mean weight, the shares of counted tokens it masked or
    truncated, of sequences it masked whole and of sequences it truncated a weight of, and the mean, smallest and
    largest ratio it saw (exp of its log weight at its level, before truncation or masking) over counted tokens."""
    tokens, sequences = max(float(terms.completion_tokens), 1e-9), max(float(terms.sequences), 1e-9)
    return {
        "correction/weight_mean": float(terms.correction_weight) / tokens,
        "correction/masked_tokens": float(terms.correction_masked) / tokens,
        "correction/truncated_tokens": float(terms.correction_truncated) / tokens,
        "correction/masked_sequences": float(terms.correction_masked_sequences) / sequences,
        "correction/truncated_sequences": float(terms.correction_truncated_sequences) / sequences,
        "correction/ratio_mean": float(terms.correction_ratio) / tokens,
        "correction/ratio_min": -float(terms.correction_ratio_min_neg),
        "correction/ratio_max": float(terms.correction_ratio_max),
    }


def mini_batch(batch: RLBatch, m: int, mini_batches: int) -> RLBatch:
    """Mini-batch m: every array's first axis cut in `mini_batches` (rows and completions alike: the batch packs
    per group), holding its share of the batch's packing groups."""
    groups = batch.packed.groups
    if groups % mini_batches:
        raise ValueError(f"a batch of {groups} packing groups cannot be cut into {mini_batches} mini-batches")
    part = jax.tree.map(lambda x: x[m * (x.shape[0] // mini_batches) : (m + 1) * (x.shape[0] // mini_batches)], batch)
    return with_groups(part, groups // mini_batches)


# ------------------------------------------------------------------ the method's update


def updates_per_step(cfg: PostTrainConfig) -> int:
    """Optimizer updates on each rollout batch: `rl.batch.num_iterations` passes of `mini_batches` each."""
    return cfg.rl.batch.num_iterations * cfg.rl.batch.mini_batches


def rl_batch(
    cfg: PostTrainConfig,
    completions: list[Completion],
    adv: Advantages,
    row_len: int,
    row_multiple: int,
    choose_rows: Callable[[int], int] | None = None,
    earlier: Sequence[Sequence[Completion]] | None = None,
) -> RLBatch:
    """The trainer's packed batch: one packing group per optimizer mini-batch x micro-batch, row counts a multiple
    of the trainer's data-parallel size (`row_multiple`; `choose_rows` reuses row counts already compiled).
    `earlier`: per completion, the trajectories of its episode before it (`Episode.earlier`), trained with its
    advantage (`rl_batch.with_segments`)."""
    rl = cfg.rl
    groups = rl.batch.mini_batches * cfg.train.micro_batches
    values, keep, trainable = adv.values, adv.keep, adv.trainable
    if earlier is not None and any(earlier):
        completions, values, (keep, trainable) = with_segments(completions, earlier, values, [keep, trainable], groups)
    # An episode that failed before it had a prompt (an environment's reset, an agent program that never called the
    # model) holds no token; its group is dropped (keep False), so one pad token keeps its place in the layout.
    completions = [c if c.prompt_ids or k else placeholder(c) for c, k in zip(completions, keep, strict=True)]
    if not rl.batch.pack_sequences:  # one sequence per row: rows as long as the longest, to a power of two
        longest = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
        row_len = min(max(16, 1 << (longest - 1).bit_length()), row_len)
    return build_rl_batch(
        completions,
        values,
        keep,
        row_len=row_len,
        max_tokens=completion_tokens(cfg),
        groups=groups,
        row_multiple=row_multiple,
        pack=rl.batch.pack_sequences,
        share_prompts=rl.batch.share_prompts,
        mask_truncated=rl.loss.mask_truncated,
        choose_rows=choose_rows,
        kl_keep=trainable if rl.loss.kl_every_token else None,
        replay=rl.router_replay == "replay",
    )


def step_advantages(
    cfg: PostTrainConfig,
    rewards: RewardBatch,
    completions: list[Completion] | None = None,
    earlier: Sequence[Sequence[Completion]] | None = None,
) -> Advantages:
    """A step's advantages by `rl.advantage` (`posttrain.advantages`: the estimator on the summed rewards, or
    GDPO's normalised sum); `completions` (with their `earlier` segments) give the batch estimators their token
    weights (each episode's trained tokens)."""
    rl = cfg.rl
    settings = advantage_settings(cfg)
    if settings.aggregation == "normalize_then_sum":
        fns = cfg.reward.functions
        weights = dict(zip(function_names([f.fn for f in fns]), [f.weight for f in fns], strict=True))
        return normalized_advantages(rewards.values, weights, rl.batch.num_generations, settings.std_eps)
    tokens = None
    if completions is not None:
        before = earlier if earlier is not None else [()] * len(completions)
        tokens = np.array([sum(map(trained_tokens, [*e, c])) for c, e in zip(completions, before, strict=True)])
        tokens = np.maximum(tokens, 1)
    return group_advantages(rewards.total, rl.batch.num_generations, settings.estimator, settings.std_eps, tokens)


def trained_tokens(c: Completion) -> int:
    """The tokens of a completion its policy term can count: the model's (an environment's are context)."""
    return sum(c.sampled) if c.sampled is not None else len(c.token_ids)


def advantage_settings(cfg: PostTrainConfig) -> AdvantageSettings:
    a = cfg.rl.advantage
    return AdvantageSettings(a.estimator, a.std_eps, a.aggregation)


@dataclass
class PolicyValues:
    """What the policy-gradient update attaches to a rollout batch: pi_old's log-probs when the step makes several
    updates (one update's own forward pass gives them: `policy_objective` holds them constant), and the
    reference's (`rl.loss.beta` > 0: the starting policy, frozen); a sampler's routes are checked against the
    model that replays them."""

    learner: Learner
    reference: FrozenModel | None
    policy_logprobs: LogprobPass
    several_updates: bool

    def __call__(self, batch: RLBatch) -> tuple[RLBatch, dict[str, float]]:
        model = self.learner.model()
        if batch.packed.routes is not None:  # a sampler's routes: ones this model can replay, or refused here
            check_routes(np.asarray(batch.packed.routes), model.cfg, "the sampler's routes")
        if self.several_updates:
            targets = np.asarray(batch.packed.target_mask) > 0
            old = grouped_logprobs(self.policy_logprobs, model, batch.packed, self.learner.mesh)
            batch = batch.replace(old_logp=old * targets)
        if self.reference is not None:
            batch = batch.replace(ref_logp=self.reference.logprobs(batch.packed))
        return batch, {}


class PolicyGradient(SamplingMethod[RLBatch]):
    """The clipped policy-gradient update of a rollout batch, what every sampling method's trainer runs (GRPO, the
    sampled-token on-policy distillation): the policy objective, pi_old's and the reference's log-probs attached,
    `rl.batch.num_iterations` x `mini_batches` updates, their `PolicyStats`. Where the batch comes from is the
    subclass's."""

    name = "RL"

    def loss(self, cfg: PostTrainConfig):
        return policy_objective(loss_settings(cfg), cfg.rollout.temperature or 1.0)

    def updates_per_step(self, cfg: PostTrainConfig) -> int:
        return updates_per_step(cfg)

    def attach(self, cfg: PostTrainConfig, learner: Learner) -> Attach[RLBatch]:
        temperature = cfg.rollout.temperature or 1.0
        reference = FrozenModel.start_of(learner, temperature=temperature) if cfg.rl.loss.beta else None
        # pi_old is the policy's own pass: on the sampler's routes, as the update's forward pass (routing replay)
        policy = LogprobPass(temperature, routed=True)
        return PolicyValues(learner, reference, policy, updates_per_step(cfg) > 1)

    def updates(self, cfg: PostTrainConfig, learner: Learner, batch: RLBatch) -> Iterator[tuple[Update, str]]:
        rl, n = cfg.rl.batch, updates_per_step(cfg)
        for u in range(n):
            yield (
                learner.update(mini_batch(batch, u % rl.mini_batches, rl.mini_batches), cfg.train.micro_batches),
                (f"update {u + 1} of {n}"),
            )

    def report(self, cfg: PostTrainConfig, updates: list[Update], attached: dict[str, float]) -> TrainStats:
        stats = PolicyStats.summarise(updates, cfg.rl.batch.num_iterations, loss_settings(cfg))
        metrics = {**stats.metrics(), **pooled_router_metrics([u.router for u in updates]), **attached}
        return TrainStats(metrics, f"clip {stats.clip_fraction:.3f} | gap {stats.mismatch_gap_mean:.2e}")
