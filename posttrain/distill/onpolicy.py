"""On-policy distillation: the student samples, the teacher scores every sampled token, the student learns from
the per-token reverse KL with the policy-gradient update (a method of the on-policy run,
`posttrain.onpolicy.run.build_sampler_run`).

    summary = fit(cfg, ON_POLICY_DISTILL)   # python -m recipes.distill CONFIG.yml distill.regime=on_policy

Each step samples `rl.batch.prompts_per_step` prompts x `rl.batch.num_generations` completions (one is enough)
from the current student with the rollout machinery GRPO uses (vLLM samplers on Ray, or the JAX sampler;
weight sync after every update; `rl.off_policy_steps` for async sampling with bounded staleness). In the trainer,
the teacher (`distill.teacher`, any checkpoint with the same tokenizer, frozen, at the sampler's temperature)
scores every sampled token, and token t's advantage is

    A_t = -(log q(x_t) - log p(x_t))  [+ distill.reward_weight * the completion's group advantage]

with log q the sampler's log-prob of the token it drew and log p the teacher's: the per-token reverse KL on the
sampled token (`posttrain.losses.distill.reverse_kl_advantages`; Agarwal et al.'s on-policy GKD with beta = 1,
the recipe of Qwen3 and of Thinking Machines' on-policy distillation). The update is the clipped
policy-gradient objective of `posttrain.onpolicy.policy_gradient` (importance ratio against the sampler, TIS,
`rl.loss.*`), so everything GRPO has (micro-batches, several updates a batch, checkpoints and exact resume) holds.
With reward functions and `distill.reward_weight` > 0 a task reward's group advantage (`rl.advantage.*`; it
needs `rl.batch.num_generations` >= 2) is added to every token of its completion.

With `distill.on_policy_loss=gkd` the update is instead GKD's (Agarwal et al., 2024; TRL's GKDTrainer and
DistillationTrainer): the divergence `distill.loss` (JSD(beta), forward or reverse KL; the whole vocabulary
through the chunked kernel, or the teacher's top-k) between the two models' full distributions at every
completion token, the teacher in the train step (`posttrain.distill.objective`, as the online regime). With
`distill.lmbda` < 1, a step is on-policy with probability lmbda (drawn from the run seed and the step: the same
on resume) and otherwise trains on the dataset's completions of the same prompts (`distill.completion_template`,
e.g. " {answer}"): GKD's mix of on-policy and supervised batches.

Metrics: `reverse_kl` (mean over sampled tokens of log q - log p: an estimate of KL(student || teacher) on the
student's own samples), `teacher_logp` (the teacher's mean log-prob of the student's tokens), and GRPO's; with
gkd, the objective's `kd`, `kl` (forward KL at T = 1) and `nll`, and `on_policy` (1 for a sampled step).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from core.config_loader import ConfigError
from core.learner import Learner
from core.loop import Plot
from core.method import Attach, TrainStats, unchanged
from core.models.lora import trainable_filter
from core.train import Update
from posttrain.config import PostTrainConfig
from posttrain.distill.objective import DistillBatch, DistillModules, distill_objective, schedules, trainable
from posttrain.distill.teacher import check_teacher_tokenizer, check_teacher_vocab, load_teacher
from posttrain.frozen import FrozenModel
from posttrain.losses.distill import reverse_kl_advantages
from posttrain.onpolicy.method import SampleContext
from posttrain.onpolicy.policy_gradient import PolicyGradient, completion_tokens, step_advantages
from posttrain.onpolicy.rl_batch import RLBatch, build_rl_batch, placeholder
from posttrain.onpolicy.step import Scored, StepData
from rollout.sampler import Completion, sample_seed


def check_config(cfg: PostTrainConfig) -> None:
    d = cfg.distill
    if cfg.rl.router_replay != "off":
        raise ConfigError(
            "rl.router_replay=replay is built for GRPO; on-policy distillation trains with its own routing"
        )
    if d.teacher is None:
        raise ConfigError("on-policy distillation needs distill.teacher (an HF directory, a Hub id or a Temper run)")
    from core.hf.hub import resolve_model

    resolve_model(d.teacher, "distill.teacher")  # a missing path fails here, not in the trainer
    if d.reward_weight > 0:
        if not cfg.reward.functions:
            raise ConfigError(f"distill.reward_weight={d.reward_weight} needs reward.functions to score with")
        if cfg.rl.batch.num_generations < 2:
            raise ConfigError(
                f"distill.reward_weight={d.reward_weight}: a reward's advantage compares each completion with the "
                f"rest of its prompt's, so rl.batch.num_generations must be >= 2, not {cfg.rl.batch.num_generations}"
            )
    if d.lmbda < 1 and d.on_policy_loss != "gkd":
        raise ConfigError(
            f"distill.lmbda={d.lmbda} trains some steps on the dataset's completions: the sampled-token advantage "
            f"is only right on the student's own samples, so set distill.on_policy_loss=gkd"
        )
    if d.lmbda < 1:  # the dataset's completions: the template's fields are the prompt rows'
        from posttrain.onpolicy.prompts import prompt_rows

        rows, _ = prompt_rows(cfg)
        try:
            d.completion_template.format(**rows[0])
        except KeyError as err:
            raise ConfigError(
                f"distill.completion_template {d.completion_template!r} names {err}, a field the prompt rows do not "
                f"have (they have {sorted(rows[0])})"
            ) from None
    r = cfg.rollout
    if d.on_policy_loss == "sampled" and (r.top_p < 1.0 or r.top_k > 0):
        raise ConfigError(
            f"distill.on_policy_loss=sampled takes the sampler's log-prob of each token it drew as log q: with "
            f"rollout.top_p={r.top_p} / rollout.top_k={r.top_k} that is the truncated distribution's, not the "
            f"student's, and the reverse-KL advantage would be biased; sample from the whole distribution "
            f"(rollout.top_p=1, rollout.top_k=-1), or use distill.on_policy_loss=gkd (it reads the student's own)"
        )
    if d.on_policy_loss == "gkd" and d.reward_weight > 0:
        raise ConfigError("distill.reward_weight mixes a reward into the sampled-token advantage: not with gkd")
    b = cfg.rl.batch
    if d.on_policy_loss == "gkd" and (b.mini_batches != 1 or b.num_iterations != 1):
        raise ConfigError(
            f"distill.on_policy_loss=gkd makes one update a step (as TRL's GKDTrainer): rl.batch.mini_batches and "
            f"rl.batch.num_iterations must be 1 (got {b.mini_batches}, {b.num_iterations}); accumulate over "
            f"train.micro_batches instead"
        )
    updates = cfg.rl.batch.mini_batches * cfg.train.micro_batches
    if (cfg.rl.batch.prompts_per_step * cfg.rl.batch.num_generations) % updates:
        raise ConfigError(
            f"rl.batch.prompts_per_step * rl.batch.num_generations must be divisible by rl.batch.mini_batches * "
            f"train.micro_batches ({updates})"
        )


def _student(cfg: PostTrainConfig) -> str:
    return str(cfg.checkpoint.init_from or "a random init")


class OnPolicyDistillMethod(PolicyGradient):
    """Completions of the student and the policy-gradient update, one advantage per token (the teacher's, made in
    the trainer, where the teacher is); or, with gkd, a `DistillBatch` of sampled or dataset completions and the
    distillation objective with the teacher in the step."""

    name = "on-policy distillation"

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def check_tokenizer(self, cfg: PostTrainConfig, tokenizer) -> None:
        if cfg.distill.on_policy_loss == "gkd":
            from posttrain.distill.method import check_top_k

            check_top_k(cfg.distill.top_k, "distill.top_k", tokenizer)
        check_teacher_tokenizer(str(cfg.distill.teacher), tokenizer)

    def plots(self, cfg: PostTrainConfig) -> tuple[Plot, ...]:
        """What the stage minimises (the reverse KL on its samples; GKD's divergence and forward KL), then accuracy."""
        if cfg.distill.on_policy_loss == "gkd":
            divergence = Plot(("kd", "kl"), "divergence.png", "divergence to the teacher (per token)")
        else:
            divergence = Plot(("reverse_kl",), "reverse_kl.png", "KL(student || teacher) on its samples (per token)")
        return (divergence, Plot(("accuracy", "eval/pass@1"), "accuracy.png", "accuracy"))

    # ------------------------------------------------------------------ what trains

    def modules(self, cfg: PostTrainConfig, model, mesh: Mesh):
        if cfg.distill.on_policy_loss != "gkd":
            return model
        return DistillModules(model, teacher=load_teacher(cfg, mesh, model.cfg.vocab_size, _student(cfg)))

    def trainable(self, cfg: PostTrainConfig):
        if cfg.distill.on_policy_loss != "gkd":
            return super().trainable(cfg)
        return trainable(trainable_filter(cfg.model))

    def loss(self, cfg: PostTrainConfig):
        if cfg.distill.on_policy_loss != "gkd":
            return super().loss(cfg)
        from posttrain.distill.method import settings

        online = cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"regime": "online"})})
        return distill_objective(settings(online), cfg.model)

    def attach(self, cfg: PostTrainConfig, learner: Learner) -> Attach:
        """The sampled-token loss: the policy-gradient update's values, and each token's reverse-KL advantage
        (the teacher's log-prob of it against the sampler's) added to the reward's. GKD: the teacher is in the
        step."""
        if cfg.distill.on_policy_loss == "gkd":
            return unchanged
        policy = super().attach(cfg, learner)
        path, vocab, temperature = (
            str(cfg.distill.teacher),
            learner.model_cfg.vocab_size,
            cfg.rollout.temperature or 1.0,
        )
        teacher = FrozenModel.load(path, learner.mesh, "teacher", temperature, cfg.distill.teacher_dtype, vocab)
        assert teacher.cfg is not None
        check_teacher_vocab(teacher.cfg.vocab_size, vocab, path, _student(cfg))

        def attach(batch: RLBatch) -> tuple[RLBatch, dict[str, float]]:
            mask = np.asarray(batch.packed.target_mask) > 0
            teacher_logp = teacher.logprobs(batch.packed)
            sampler = np.asarray(batch.sampler_logp, np.float32)
            kl_adv = np.asarray(reverse_kl_advantages(jnp.asarray(sampler), jnp.asarray(teacher_logp))) * mask
            batch, attached = policy(batch.replace(advantages=np.asarray(batch.advantages, np.float32) + kl_adv))
            n = max(int(mask.sum()), 1)
            measured = {
                "reverse_kl": float(-(kl_adv[mask]).sum() / n),
                "teacher_logp": float(teacher_logp[mask].sum() / n),
            }
            return batch, {**attached, **measured}

        return attach

    def updates(self, cfg: PostTrainConfig, learner: Learner, batch) -> Iterator[tuple[Update, str]]:
        if cfg.distill.on_policy_loss == "gkd":  # one update a step (checked), as TRL's GKDTrainer
            yield learner.update(batch, cfg.train.micro_batches), ""
        else:
            yield from super().updates(cfg, learner, batch)

    def report(self, cfg: PostTrainConfig, updates: list[Update], attached: dict[str, float]) -> TrainStats:
        if cfg.distill.on_policy_loss == "gkd":
            out = updates[-1].metrics()
            return TrainStats(out, f"kd {out['kd']:.4f} | kl {out['kl']:.4f}")
        stats = super().report(cfg, updates, attached)
        return TrainStats(stats.metrics, f"rkl {attached['reverse_kl']:.4f} | {stats.line}")

    # ------------------------------------------------------------------ the batch

    def from_samples(self, cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
        if cfg.distill.on_policy_loss == "gkd":
            return gkd_batch(cfg, scored, ctx)
        return sampled_batch(cfg, scored, ctx)


ON_POLICY_DISTILL = OnPolicyDistillMethod()


def gkd_batch(cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
    """GKD's batch: the sampled completions with probability `distill.lmbda` (drawn from the run seed and the
    step: the same on resume), else the dataset's completions of the same prompts."""
    d, rl = cfg.distill, cfg.rl
    on_policy = bool(np.random.default_rng(sample_seed(cfg.run.seed, ctx.step)).random() < d.lmbda)
    # a failed episode's row trains nothing, its dataset completion neither (the episode's prompt may be empty)
    trains = trained_episodes(scored)
    if not on_policy:
        scored = Scored(scored.rows, dataset_completions(cfg, scored, ctx.tokenizer), None, None)
    packed = build_rl_batch(
        [c if t else placeholder(c) for c, t in zip(scored.completions, trains, strict=True)],
        np.zeros(len(scored.completions), np.float32),
        trains,
        row_len=ctx.row_len,
        max_tokens=completion_tokens(cfg),
        groups=cfg.train.micro_batches,  # GKD makes one update a step, accumulated over the micro-batches
        row_multiple=ctx.row_multiple,
        share_prompts=rl.batch.share_prompts,
    ).packed
    batch = DistillBatch(packed, **schedules(d, ctx.step - 1, cfg.train.steps, packed.target_ids.shape[0]))
    return StepData(batch, scored, {"on_policy": float(on_policy)})


def trained_episodes(scored: Scored) -> np.ndarray:
    """[N] bool: which completions train (all but failed episodes: a partial trajectory, or none at all)."""
    if scored.episodes is None:
        return np.ones(len(scored.completions), bool)
    return np.array([e.finish != "failed" for e in scored.episodes])


def dataset_completions(cfg: PostTrainConfig, scored: Scored, tokenizer) -> list[Completion]:
    """The dataset's completion of each sampled completion's prompt (`distill.completion_template`), cut to
    `rollout.max_tokens` tokens."""
    from core.encoding import encode_completion

    per_row = len(scored.completions) // len(scored.rows)
    out = []
    for i, c in enumerate(scored.completions):
        text = cfg.distill.completion_template.format(**scored.rows[i // per_row])  # checked at start
        ids = encode_completion(tokenizer, text)[: cfg.rollout.max_tokens]
        out.append(Completion(c.prompt_ids, ids, [0.0] * len(ids), "stop", text, c.policy_version))
    return out


def sampled_batch(cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
    """The sampled-token loss's batch: the reward's group advantage per token (`distill.reward_weight`; the
    trainer adds the teacher's)."""
    completions, d = scored.completions, cfg.distill
    reward = np.zeros(len(completions), np.float32)
    metrics: dict[str, float] = {}
    if scored.rewards is not None and d.reward_weight > 0:
        adv = step_advantages(cfg, scored.rewards, completions)
        reward = d.reward_weight * np.asarray(adv.values, np.float32)
        metrics["zero_variance_groups"] = float(adv.zero_variance_groups)
    trains = trained_episodes(scored)
    completions = [c if t else placeholder(c) for c, t in zip(completions, trains, strict=True)]
    advantages = [np.full(len(c.token_ids), reward[i], np.float32) for i, c in enumerate(completions)]
    batch = build_rl_batch(
        completions,
        advantages,
        trains,
        row_len=ctx.row_len,
        max_tokens=completion_tokens(cfg),
        groups=cfg.rl.batch.mini_batches * cfg.train.micro_batches,
        row_multiple=ctx.row_multiple,
        share_prompts=cfg.rl.batch.share_prompts,
    )
    return StepData(batch, scored, metrics)
