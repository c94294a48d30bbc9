"""The policy-gradient update every sampling method trains with: its batch, its objective, its learner.

    batch = build_rl_batch(completions, advantages, keep, row_len=128, max_tokens=16, groups=4)
    learner = PolicyGradientLearner(cfg, model, mesh, total_steps=cfg.train.steps)
    stats = learner.train(batch)        # one step: pi_old / reference passes, then the clipped updates

The batch (`RLBatch`, pure NumPy): completions packed into rows by `core.packing` (several per row, first-fit
decreasing, each in its own segment). With `share_prompts` (the default) the completions of one prompt share a
single copy of it: the segment holds the prompt (branch 0) followed by each completion (branch k), which attends
to the prompt and to itself only, with positions that continue from the prompt's. GRPO samples several
completions per prompt, so this trains on each prompt token once instead of once per completion (same gradient:
the prompt's hidden states do not depend on what follows). Per completion token `[B, C]`:

    packed.target_*   the completion's tokens, and where each is predicted
    loss_mask         1 where token j's policy term counts: the model sampled it (not an environment), its group
                      has signal (DAPO's mask_truncated)
    kl_mask           1 where token j's KL term counts (`kl_keep`)
    sampler_logp      the sampler's log-prob of token j
    advantages        token j's advantage: a completion's one value broadcast over its tokens (GRPO), or a value
                      per token (on-policy distillation)
    old_logp, ref_logp   pi_old's and the reference's log-probs, filled in by the learner when needed

Sequences are packed in `groups` contiguous groups (one per optimizer mini-batch x micro-batch), each into the
same number of rows, so that cutting every array into `groups` equal slices along its first axis gives
self-contained micro-batches.

The learner (`PolicyGradientLearner`): one step is `rl.batch.num_iterations` passes over the batch, each cut into
`rl.batch.mini_batches` optimizer updates (each accumulated over `train.micro_batches`), on a
`core.learner.Learner` whose loss is `policy_objective` (`posttrain.losses.policy`: clipping, TIS, the KL term).
The reference (`rl.loss.beta` > 0) is a `posttrain.frozen.FrozenModel`, a frozen copy of the starting policy;
pi_old's log-probs come from the update's own forward pass when the step has one update (held constant by a
stop-gradient: no extra pass), else from one pass up front. Its statistics come back typed (`PolicyStats`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from core.batch import PackedBatch, with_groups
from core.learner import Learner
from core.models.moe import check_routes
from core.packing import PackedRows, Segment, branch_targets, pack_rows, packed_batch, share_prefixes
from core.router_loss import pooled_router_metrics
from core.sums import combine, maximum, summed
from core.targets import target_logprobs
from core.train import LossOutput, Update
from posttrain.config import PostTrainConfig
from posttrain.frozen import FrozenModel, LogprobPass, grouped_logprobs
from posttrain.losses.policy import PolicyLossSettings, PolicyTerms, policy_loss
from posttrain.onpolicy.learner import PolicyLearner, TrainStats
from rollout.sampler import Completion


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RLBatch:
    packed: PackedBatch
    loss_mask: Any  # [B, C] float32
    kl_mask: Any  # [B, C] float32
    advantages: Any  # [B, C] float32
    sampler_logp: Any  # [B, C] float32
    old_logp: Any = None  # [B, C] float32 pi_old; None: the update starts at pi_old (its own pass)
    ref_logp: Any = None  # [B, C] float32 the reference; None when beta = 0

    def replace(self, **changes: Any) -> RLBatch:
        return dataclasses.replace(self, **changes)


def build_rl_batch(
    completions: Sequence[Completion],
    advantages: np.ndarray | Sequence[np.ndarray],
    keep: np.ndarray,
    *,
    row_len: int,
    max_tokens: int,
    groups: int = 1,
    row_multiple: int = 1,
    pack: bool = True,
    share_prompts: bool = True,
    mask_truncated: bool = False,
    kl_keep: np.ndarray | None = None,
    pad_id: int = 0,
    choose_rows: Callable[[int], int] | None = None,
    replay: bool = False,
) -> RLBatch:
    """The batch of `completions` (layout in the module docstring).

    `advantages` is one value per completion (`[N]`, broadcast over its tokens) or one array per completion with a
    value per token. `keep` (e.g. False for zero-variance groups) and, with `mask_truncated`
    (DAPO), completions that hit the length limit contribute no policy-loss
    tokens. `kl_keep` says whose tokens carry the KL term (e.g. every
    completion but those of failed groups, truncated or not); None: the same
    tokens as the policy term. `pack=False` puts one sequence in each row (no
    shared prompts). `row_multiple` (the trainer's data-parallel size) divides
    every group's row count; `choose_rows` maps the rows a group needs to the
    rows it gets (default `core.packing.round_rows`; `posttrain.grpo` passes a
    `core.shapes.SizeCache` so that a row count already compiled is reused).

    When every completion carries its routes (`Completion.routes`: a mixture-of-experts sampler's), the batch
    carries them in the row layout (`PackedBatch.routes`), used in the forward pass with `replay` (routing
    replay), else only compared with the trainer's own routing.
    """
    b = len(completions)
    if b % groups:
        raise ValueError(f"{b} completions are not divisible into {groups} groups (mini-batches x micro-batches)")
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.token_ids)
        if p < 1 or n > max_tokens:
            raise ValueError(f"completion {i}: prompt {p} tokens (need >= 1), completion {n} > max_tokens {max_tokens}")
        if p + n > row_len:
            raise ValueError(f"completion {i}: prompt {p} + completion {n} tokens > row length {row_len}")
    per_group = b // groups
    grouped: list[list[list[int]]] = []  # per group: segments, each the completion indices sharing one prompt copy
    for g in range(groups):
        members = list(range(g * per_group, (g + 1) * per_group))
        if pack and share_prompts:
            found = share_prefixes(
                [completions[i].prompt_ids for i in members], [len(completions[i].token_ids) for i in members], row_len
            )
            grouped.append([[members[k] for k in segment] for segment in found])
        else:
            grouped.append([[i] for i in members])
    segments = [
        [Segment(completions[s[0]].prompt_ids, tuple(completions[i].token_ids for i in s)) for s in group]
        for group in grouped
    ]
    rows = pack_rows(segments, row_len, pack=pack, row_multiple=row_multiple, choose_rows=choose_rows, pad_id=pad_id)
    targets: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int32), np.zeros(0, np.int32))] * b
    for g, group in enumerate(grouped):
        for s, members in enumerate(group):
            for branch, i in enumerate(members, start=1):
                targets[i] = branch_targets(rows, g, s, branch)
    packed = packed_batch(rows, targets, max_tokens)
    if all(c.routes is not None for c in completions):
        packed = dataclasses.replace(packed, routes=row_routes(rows, grouped, completions), replay=replay)
    elif replay:
        missing = sum(c.routes is None for c in completions)
        raise ValueError(
            f"rl.router_replay=replay, but {missing} of {b} completions came without routes (Completion.routes): a "
            "dense policy has none to replay"
        )
    # An environment's tokens in a multi-turn trajectory (`Completion.sampled`) are context: not targets at all, so
    # the head never scores them and no loss, KL, entropy or mismatch figure reads them.
    mask = np.asarray(packed.target_mask)
    for i, c in enumerate(completions):
        if c.sampled is not None:
            if len(c.sampled) != len(c.token_ids):
                raise ValueError(f"completion {i}: {len(c.sampled)} sampled flags for its {len(c.token_ids)} tokens")
            mask[i, : len(c.sampled)] *= np.asarray(c.sampled, mask.dtype)
    loss_mask = np.zeros((b, max_tokens), np.float32)
    kl_mask = np.zeros((b, max_tokens), np.float32)
    sampler_logp = np.zeros((b, max_tokens), np.float32)
    token_adv = np.zeros((b, max_tokens), np.float32)
    per_sequence = isinstance(advantages, np.ndarray) and advantages.ndim == 1
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if per_sequence:
            token_adv[i, :n] = advantages[i]
        else:
            values = np.asarray(advantages[i], np.float32)
            if values.shape != (n,):
                raise ValueError(f"completion {i}: {values.shape} advantages for its {n} tokens")
            token_adv[i, :n] = values
        if c.logprobs is not None:
            sampler_logp[i, :n] = c.logprobs
        own = mask[i, :n]  # the model's own tokens (an environment's are context)
        if bool(keep[i]) and not (mask_truncated and c.finish_reason == "length"):
            loss_mask[i, :n] = own
        kl_mask[i, :n] = loss_mask[i, :n] if kl_keep is None else float(bool(kl_keep[i])) * own
    return RLBatch(packed, loss_mask, kl_mask, token_adv, sampler_logp)


def row_routes(rows: PackedRows, grouped: list[list[list[int]]], completions: Sequence[Completion]) -> np.ndarray:
    """The completions' routes (`Completion.routes`, [tokens, sparse layers, k] each) at their tokens' places in the
    packed rows: [R, L, sparse layers, k] int32, -1 on padding. A segment's shared prompt takes its first member's
    prompt routes (a prompt's prefill routes the same whichever sample it starts). Routes that do not cover their
    completion's tokens are refused, naming the completion."""
    routes = [c.routes for c in completions]
    shape = routes[0].shape[1:]  # type: ignore[union-attr]
    for i, (c, r) in enumerate(zip(completions, routes, strict=True)):
        want = (len(c.prompt_ids) + len(c.token_ids), *shape)
        if r is None or r.shape != want:
            raise ValueError(
                f"completion {i}: routes of shape {None if r is None else r.shape} for its prompt and completion "
                f"tokens (expected {want})"
            )
    out = np.full((*rows.tokens.shape, *shape), -1, np.int32)
    for g, group in enumerate(grouped):
        for s, members in enumerate(group):
            place = rows.placements[g][s]
            row = g * rows.rows_per_group + place.row
            p = len(completions[members[0]].prompt_ids)
            out[row, place.start : place.start + p] = routes[members[0]][:p]  # type: ignore[index]
            for start, i in zip(place.branch_starts, members, strict=True):
                n = len(completions[i].token_ids)
                out[row, start : start + n] = routes[i][p : p + n]  # type: ignore[index]
    return out


# ------------------------------------------------------------------ the objective


def completion_tokens(cfg: PostTrainConfig) -> int:
    """The most tokens a completion holds: `rollout.max_tokens`; in multi-turn rollouts (`rl.agent`) every token
    after the prompt, the model's and the environment's (`rollout.max_model_len` bounds them)."""
    return cfg.rollout.max_model_len if cfg.rl.agent is not None else cfg.rollout.max_tokens


def loss_settings(cfg: PostTrainConfig) -> PolicyLossSettings:
    loss = cfg.rl.loss
    return PolicyLossSettings(
        algorithm=cfg.rl.algorithm,
        epsilon=loss.epsilon,
        epsilon_high=loss.epsilon_high,
        dual_clip=loss.dual_clip,
        tis_cap=loss.tis_cap,
        beta=loss.beta,
        kl_estimator=loss.kl_estimator,
        loss_agg=loss.loss_agg,
        max_tokens=completion_tokens(cfg),
    )


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
        logp, entropy = target_logprobs(model, batch.packed, temperature, rng=rng)
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
    every completion token once). `kl` and `tis_weight_mean` are None where their term is off."""

    loss: float
    grad_norm: float
    learning_rate: float
    clip_fraction: float
    entropy: float
    kl: float | None
    tis_weight_mean: float | None
    mismatch_gap_mean: float
    mismatch_gap_max: float
    mismatch_seq_kl: float

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
            tis_weight_mean=ratio(every.terms.tis_weight, tokens) if settings.tis_cap is not None else None,
            mismatch_gap_mean=ratio(first.mismatch_gap, first.mismatch_tokens),
            mismatch_gap_max=max(float(first.mismatch_gap_max), 0.0),
            mismatch_seq_kl=ratio(first.mismatch_seq_kl, first.mismatch_sequences),
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
        }
        if self.kl is not None:
            out["kl"] = self.kl
        if self.tis_weight_mean is not None:
            out["tis_weight_mean"] = self.tis_weight_mean
        return out


def mini_batch(batch: RLBatch, m: int, mini_batches: int) -> RLBatch:
    """Mini-batch m: every array's first axis cut in `mini_batches` (rows and completions alike: the batch packs
    per group), holding its share of the batch's packing groups."""
    groups = batch.packed.groups
    if groups % mini_batches:
        raise ValueError(f"a batch of {groups} packing groups cannot be cut into {mini_batches} mini-batches")
    part = jax.tree.map(lambda x: x[m * (x.shape[0] // mini_batches) : (m + 1) * (x.shape[0] // mini_batches)], batch)
    return with_groups(part, groups // mini_batches)


# ------------------------------------------------------------------ the learner


def updates_per_step(cfg: PostTrainConfig) -> int:
    """Optimizer updates on each rollout batch: `rl.batch.num_iterations` passes of `mini_batches` each."""
    return cfg.rl.batch.num_iterations * cfg.rl.batch.mini_batches


def policy_update_learner(
    cfg: PostTrainConfig, model, mesh: Mesh, total_steps: int, tx: optax.GradientTransformation | None = None
) -> Learner:
    """The learner of the clipped policy objective, its schedule over every update of `total_steps` RL steps (what
    `PolicyGradientLearner` trains with, and `posttrain.grpo.compile_step` compiles)."""
    return Learner(
        model,
        mesh,
        policy_objective(loss_settings(cfg), cfg.rollout.temperature or 1.0),
        cfg.optim,
        total_updates=total_steps * updates_per_step(cfg),
        seed=cfg.run.seed,
        tx=tx,
        compile_ahead=cfg.compile.ahead,
    )


class PolicyGradientLearner(PolicyLearner[RLBatch]):
    """The policy, its reference (rl.loss.beta > 0) and the clipped update schedule of one rollout batch."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        model,
        mesh: Mesh,
        total_steps: int,
        tx: optax.GradientTransformation | None = None,
    ):
        """`tx` replaces the optimizer `cfg.optim` describes (e.g. one that records gradients, in tests)."""
        super().__init__(cfg, mesh)
        self.updates_per_step = updates_per_step(cfg)
        self.temperature = cfg.rollout.temperature or 1.0
        self.settings = loss_settings(cfg)
        self.learner = policy_update_learner(cfg, model, mesh, total_steps, tx)
        # The reference is the starting policy, frozen (beta = 0: none at all).
        self.reference = FrozenModel.start_of(self.learner, temperature=self.temperature) if cfg.rl.loss.beta else None
        self._policy_logprobs = LogprobPass(self.temperature)

    def train(self, batch: RLBatch) -> TrainStats:
        """One step on a rollout batch; returns its metrics (`PolicyStats`, and the update counts)."""
        rl, micro = self.cfg.rl.batch, self.cfg.train.micro_batches
        if batch.packed.routes is not None:  # a sampler's routes: ones this model can replay, or refused here
            check_routes(np.asarray(batch.packed.routes), self.learner.model().cfg, "the sampler's routes")
        # One update per batch starts at pi_old, so the step's own forward pass gives pi_old's log-probs
        # (objective: stop_gradient(logp)); more updates need them fixed up front, one extra pass.
        targets = np.asarray(batch.packed.target_mask) > 0
        if self.updates_per_step > 1:
            old = grouped_logprobs(self._policy_logprobs, self.learner.model(), batch.packed, self.mesh)
            batch = batch.replace(old_logp=old * targets)
        if self.reference is not None:
            batch = batch.replace(ref_logp=self.reference.logprobs(batch.packed))
        collected: list[Update] = []
        start = time.perf_counter()
        for u in range(self.updates_per_step):
            update = self.learner.update(mini_batch(batch, u % rl.mini_batches, rl.mini_batches), micro)
            self._applied(update, f"RL step {self.version + 1}, update {u + 1} of {self.updates_per_step}")
            collected.append(update)
        self.version += 1
        stats = PolicyStats.summarise(collected, rl.num_iterations, self.settings)
        metrics = {
            **stats.metrics(),
            **pooled_router_metrics([u.router for u in collected]),
            "skipped_updates": float(self.skipped_updates),
            "empty_updates": float(self.empty_updates),
            "time/update_s": time.perf_counter() - start,
        }
        return TrainStats(metrics, f"clip {stats.clip_fraction:.3f} | gap {stats.mismatch_gap_mean:.2e}")
