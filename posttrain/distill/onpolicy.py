"""On-policy distillation: the student samples, the teacher scores every sampled token, the student learns from
the per-token reverse KL with the policy-gradient update (a method of `posttrain.onpolicy.run.OnPolicyRun`).

    summary = run_onpolicy_distill(cfg)     # python -m recipes.distill CONFIG.yml distill.regime=on_policy

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

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from core.config_loader import ConfigError
from core.loop import Plot
from posttrain.advantages import group_advantages
from posttrain.config import PostTrainConfig
from posttrain.distill.objective import DistillBatch, DistillModules, distill_objective, schedules, trainable
from posttrain.distill.teacher import check_teacher_vocab, load_teacher, teacher_tokenizer_matches
from posttrain.frozen import FrozenModel
from posttrain.losses.distill import reverse_kl_advantages
from posttrain.onpolicy.learner import PolicyLearner, TrainStats
from posttrain.onpolicy.policy_gradient import PolicyGradientLearner, completion_tokens
from posttrain.onpolicy.rl_batch import RLBatch, build_rl_batch
from posttrain.onpolicy.run import OnPolicyRun, RunSummary, run_to_end
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
    from core.hub import resolve_model

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


class OnPolicyDistillLearner(PolicyGradientLearner):
    """The policy-gradient learner with a teacher beside it: the reverse-KL advantages are made here, where the
    teacher is."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        model,
        mesh: Mesh,
        total_steps: int,
        tx: optax.GradientTransformation | None = None,
    ):
        super().__init__(cfg, model, mesh, total_steps, tx)
        path, vocab = str(cfg.distill.teacher), self.learner.model_cfg.vocab_size
        self.teacher = FrozenModel.load(path, mesh, "teacher", self.temperature, cfg.distill.teacher_dtype, vocab)
        assert self.teacher.cfg is not None
        check_teacher_vocab(self.teacher.cfg.vocab_size, self.learner.model_cfg.vocab_size, path, _student(cfg))

    def train(self, batch: RLBatch) -> TrainStats:
        mask = np.asarray(batch.packed.target_mask) > 0
        teacher = self.teacher.logprobs(batch.packed)
        sampler = np.asarray(batch.sampler_logp, np.float32)
        kl_adv = np.asarray(reverse_kl_advantages(jnp.asarray(sampler), jnp.asarray(teacher))) * mask
        stats = super().train(batch.replace(advantages=np.asarray(batch.advantages, np.float32) + kl_adv))
        n = max(int(mask.sum()), 1)
        reverse_kl = float(-(kl_adv[mask]).sum() / n)
        metrics = {**stats.metrics, "reverse_kl": reverse_kl, "teacher_logp": float(teacher[mask].sum() / n)}
        return TrainStats(metrics, f"rkl {reverse_kl:.4f} | {stats.line}")


class GKDLearner(PolicyLearner[DistillBatch]):
    """The student trained on the distillation objective with the teacher in the step (GKD): one update a step."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        model,
        mesh: Mesh,
        total_steps: int,
        tx: optax.GradientTransformation | None = None,
    ):
        from core.learner import Learner
        from core.models.lora import trainable_filter
        from posttrain.distill.method import settings

        super().__init__(cfg, mesh)
        teacher = load_teacher(cfg, mesh, model.cfg.vocab_size, _student(cfg))
        online = cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"regime": "online"})})
        objective = distill_objective(settings(online), model.cfg)
        self.learner = Learner(
            DistillModules(model, teacher=teacher),
            mesh,
            objective,
            cfg.optim,
            total_steps,
            cfg.run.seed,
            tx,
            trainable=trainable(trainable_filter(model.cfg)),
            compile_ahead=cfg.compile.ahead,
        )

    def train(self, batch: DistillBatch) -> TrainStats:
        update = self.learner.update(batch, self.cfg.train.micro_batches)
        self._applied(update, f"step {self.version + 1}")
        self.version += 1
        out = update.metrics()
        out.update(skipped_updates=float(self.skipped_updates), empty_updates=float(self.empty_updates))
        return TrainStats(out, f"kd {out['kd']:.4f} | kl {out['kl']:.4f}")


def distill_learner(cfg: PostTrainConfig, model, mesh: Mesh, total_steps: int) -> PolicyLearner:
    """The on-policy learner `distill.on_policy_loss` names (a `LearnerFactory`)."""
    if cfg.distill.on_policy_loss == "gkd":
        return GKDLearner(cfg, model, mesh, total_steps)
    return OnPolicyDistillLearner(cfg, model, mesh, total_steps)


class OnPolicyDistillRun(OnPolicyRun):
    """Completions of the student, one advantage per token (made in the trainer), an `RLBatch`; or, with gkd, a
    `DistillBatch` of sampled or dataset completions."""

    learner_class = staticmethod(distill_learner)

    @property
    def plots(self) -> tuple[Plot, ...]:  # type: ignore[override]
        """What the stage minimises (the reverse KL on its samples; GKD's divergence and forward KL), then accuracy."""
        if self.cfg.distill.on_policy_loss == "gkd":
            divergence = Plot(("kd", "kl"), "divergence.png", "divergence to the teacher (per token)")
        else:
            divergence = Plot(("reverse_kl",), "reverse_kl.png", "KL(student || teacher) on its samples (per token)")
        return (divergence, Plot(("accuracy", "eval/pass@1"), "accuracy.png", "accuracy"))

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def check_tokenizer(self, tokenizer_dir: str) -> None:
        from core.data import load_tokenizer

        super().check_tokenizer(tokenizer_dir)
        if self.cfg.distill.on_policy_loss == "gkd":
            from posttrain.distill.method import check_top_k

            check_top_k(self.cfg.distill.top_k, "distill.top_k", load_tokenizer(tokenizer_dir))
        teacher = str(self.cfg.distill.teacher)
        mismatch = teacher_tokenizer_matches(teacher, load_tokenizer(tokenizer_dir), tokenizer_dir)
        if mismatch:
            raise ConfigError(mismatch)

    def _prepare(self, scored: Scored) -> StepData:
        if not hasattr(self, "_step_index"):
            self._step_index = self.start_step
        self._step_index += 1
        if self.cfg.distill.on_policy_loss == "gkd":
            return self._gkd_batch(scored, self._step_index)
        return self._sampled_batch(scored)

    def _gkd_batch(self, scored: Scored, step: int) -> StepData:
        d, rl = self.cfg.distill, self.cfg.rl
        on_policy = bool(np.random.default_rng(sample_seed(self.cfg.run.seed, step)).random() < d.lmbda)
        if not on_policy:
            scored = Scored(scored.rows, self._dataset_completions(scored), None, None)
        packed = build_rl_batch(
            scored.completions,
            np.zeros(len(scored.completions), np.float32),
            np.ones(len(scored.completions), bool),
            row_len=self.row_len,
            max_tokens=completion_tokens(self.cfg),
            groups=self.cfg.train.micro_batches,  # GKD makes one update a step, accumulated over the micro-batches
            row_multiple=self.row_multiple,
            share_prompts=rl.batch.share_prompts,
        ).packed
        batch = DistillBatch(packed, **schedules(d, step - 1, self.cfg.train.steps, packed.target_ids.shape[0]))
        return StepData(batch, scored, {"on_policy": float(on_policy)})

    def _dataset_completions(self, scored: Scored) -> list[Completion]:
        """The dataset's completion of each sampled completion's prompt (`distill.completion_template`), cut to
        `rollout.max_tokens` tokens."""
        from core.data import load_tokenizer
        from core.encoding import encode_completion

        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
        per_row = len(scored.completions) // len(scored.rows)
        out = []
        for i, c in enumerate(scored.completions):
            text = self.cfg.distill.completion_template.format(**scored.rows[i // per_row])  # checked at start
            ids = encode_completion(self._tokenizer, text)[: self.cfg.rollout.max_tokens]
            out.append(Completion(c.prompt_ids, ids, [0.0] * len(ids), "stop", text, c.policy_version))
        return out

    def _sampled_batch(self, scored: Scored) -> StepData:
        completions, d = scored.completions, self.cfg.distill
        reward = np.zeros(len(completions), np.float32)
        metrics: dict[str, float] = {}
        if scored.rewards is not None and d.reward_weight > 0:
            rl = self.cfg.rl
            adv = group_advantages(
                scored.rewards.total, rl.batch.num_generations, rl.advantage.estimator, rl.advantage.std_eps
            )
            reward = d.reward_weight * np.asarray(adv.values, np.float32)
            metrics["zero_variance_groups"] = float(adv.zero_variance_groups)
        # The reward part per token; the trainer adds the teacher's.
        advantages = [np.full(len(c.token_ids), reward[i], np.float32) for i, c in enumerate(completions)]
        batch = build_rl_batch(
            completions,
            advantages,
            np.ones(len(completions), bool),
            row_len=self.row_len,
            max_tokens=completion_tokens(self.cfg),
            groups=self.cfg.rl.batch.mini_batches * self.cfg.train.micro_batches,
            row_multiple=self.row_multiple,
            share_prompts=self.cfg.rl.batch.share_prompts,
        )
        return StepData(batch, scored, metrics)


def run_onpolicy_distill(cfg: PostTrainConfig) -> RunSummary:
    return run_to_end(OnPolicyDistillRun(cfg))
