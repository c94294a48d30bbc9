"""The post-training methods' config: the core sections plus `rollout`, `reward`, `rl` (its sections in
`posttrain.rl_config`), `sft`, `dpo`, `reward_model`, `distill`, `ppo`.

    cfg = load_config("recipes/configs/grpo_tiny.yml", overrides, schema=PostTrainConfig)

Each section is one pydantic model, closed (unknown keys fail with the dotted key that exists) and validated on
its own. What a method needs of several sections at once is checked by the method when its run is built
(`posttrain.sft.check_config`, `posttrain.dpo.offline.check_config`, `posttrain.onpolicy.checks.check_config`,
`posttrain.grpo.check_config`, ...), before any work starts: an SFT job never fails on RL's checks. The values an
option may take are defined once, by the code that reads them (the loss modules' Literals and registries), and
imported here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.config import Config, Section
from core.kernels.divergence import Divergence
from posttrain.losses.distill import FeatureKind, Schedule, TopKMode
from posttrain.losses.preference import SMOOTHED, LossType
from posttrain.rl_config import (  # noqa: F401  (re-exported: the rl sections are read as posttrain.config's)
    GMPO_EPSILON,
    GSPO_EPSILON,
    GSPO_EPSILON_HIGH,
    AdvantageConfig,
    AgentConfig,
    RLBatchConfig,
    RLConfig,
    RLLossConfig,
    RolloutCorrectionConfig,
)
from rewards.config import RewardConfig, check_reward_functions
from rollout.config import RolloutConfig

# ---------------------------------------------------------------------------- sft


class SFTConfig(Section):
    """Supervised fine-tuning (posttrain/sft.py; docs/sft.md)."""

    # Train only on assistant / completion tokens (prompt, system and user tokens masked out).
    completion_only_loss: bool = True
    # At each evaluation (train.eval_every): greedy completions of this many held-out prompts, logged to
    # run_dir/generations.jsonl (0: none).
    eval_generations: int = Field(4, ge=0)
    eval_max_new_tokens: int = Field(64, gt=0)


# ---------------------------------------------------------------------------- reward model


class RewardModelConfig(Section):
    """A Bradley-Terry reward model on preference pairs (posttrain/reward_model.py; docs/reward_models.md)."""

    margin: float = Field(0.0, ge=0.0)  # -log sigmoid(r_chosen - r_rejected - margin)


# ---------------------------------------------------------------------------- dpo


class DPOConfig(Section):
    """Preference optimisation (posttrain/dpo/; docs/dpo.md)."""

    loss_type: LossType = "sigmoid"
    beta: float = Field(0.1, gt=0.0)  # ORPO: the odds-ratio term's weight (lambda)
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)  # sigmoid (cDPO), robust, exo_pair, simpo
    simpo_gamma: float = 0.5  # SimPO's target margin
    rpo_alpha: float = Field(0.0, ge=0.0)  # weight of the chosen completion's mean NLL, any loss type
    # Prompts keep their last tokens, completions their first (None: only data.seq_len bounds a pair).
    max_prompt_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    # Score every pair with the reference once, before training, into run_dir/reference_logps.npz (reused on
    # resume while the pairs and the reference's weights are the same) and release the reference; False: score
    # each batch live, the reference held in memory.
    precompute_ref_logps: bool = False
    # Online DPO (posttrain/dpo/online.py): pairs from the policy's own samples, the best and worst of
    # rl.batch.num_generations per prompt by the reward functions, with the sampler, reward and rl.* settings GRPO
    # reads; False: offline, pairs from data.source.
    online: bool = False
    # Online DPO: subtracted from the reward of a sample cut at rollout.max_tokens (no end-of-sequence token)
    # before the pair is picked, as TRL's missing_eos_penalty; None (the default, as TRL's): no penalty.
    missing_eos_penalty: float | None = Field(None, ge=0.0)

    @model_validator(mode="after")
    def _check_smoothing(self) -> DPOConfig:
        if self.label_smoothing > 0 and self.loss_type not in SMOOTHED:
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing}: loss_type {self.loss_type!r} has no label smoothing "
                f"(only {', '.join(SMOOTHED)} do)"
            )
        return self


# ---------------------------------------------------------------------------- distill

Regime = Literal["offline", "online", "on_policy"]
OnPolicyLoss = Literal["sampled", "gkd"]
LogitDtype = Literal["float32", "float16", "bfloat16"]


SCHEDULED = ("alpha", "temperature", "feature_weight")  # the distillation values that may follow a schedule


class DistillConfig(Section):
    """Teacher-student distillation (posttrain/distill/; docs/distillation.md).

    `regime`: offline (the student trains on a teacher's top-k dumped once by `recipes.distill_logits` into
    `logits_dir`), online (the teacher beside the student scores each batch in the step) or on_policy (the
    student samples, the teacher scores every sampled token: per-token reverse-KL advantages)."""

    regime: Regime = "offline"
    teacher: str | None = None  # an HF directory, a Hub id or a Temper run (online, on_policy, and the dump)
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    # Online: the teacher beside the student in the train step, or in a Ray actor of its own (a teacher that does
    # not fit beside the student), answering each batch with its top-k (`top_k` > 0) on `teacher_gpus` GPUs (0: CPU).
    teacher_placement: Literal["beside", "actor"] = "beside"
    teacher_gpus: float = Field(0.0, ge=0.0)
    teacher_timeout_s: float = Field(600.0, gt=0.0)  # the longest a teacher actor may take over one batch
    logits_dir: str | None = None  # offline: the top-k shards (written by recipes.distill_logits)
    # The divergence trained on (offline, online): forward KL(teacher || student), reverse, or TRL's JSD(beta).
    loss: Divergence = "forward"
    beta: float = Field(0.5, ge=0.0, le=1.0)  # jsd's beta (0 = forward, 1 = reverse, as TRL's GKD)
    # Online: 0 = the whole vocabulary (the chunked kernel); k > 0 = the teacher's top-k. Offline: the dump's k.
    top_k: int = Field(0, ge=0)
    top_k_mode: TopKMode = "renormalised"
    temperature: float = Field(1.0, gt=0.0)
    temperature_end: float | None = Field(None, gt=0.0)  # None: temperature
    temperature_schedule: Schedule = "constant"
    alpha: float = Field(0.0, ge=0.0, le=1.0)  # weight of the hard-label NLL: (1 - alpha) T^2 KD + alpha NLL
    alpha_end: float | None = Field(None, ge=0.0, le=1.0)
    alpha_schedule: Schedule = "constant"
    t2_scaling: bool = True  # Hinton's T^2 on the soft term (a no-op at T = 1)
    # Online: a feature loss between hidden states, added with weight feature_weight (on its own schedule). Each
    # pair is [student layer, teacher layer], counted from 1 (the residual stream after that decoder layer); the
    # student's states go through a learned projection when the widths differ (Tunix's feature strategies).
    feature_layers: list[tuple[int, int]] = Field(default_factory=list)
    feature_loss: FeatureKind = "cosine"
    feature_weight: float = Field(0.0, ge=0.0)
    feature_weight_end: float | None = Field(None, ge=0.0)
    feature_weight_schedule: Schedule = "constant"
    # The dump (recipes.distill_logits): k ids per target, their log-probs' dtype, rows per shard, temperature.
    dump_k: int = Field(128, gt=0)
    dump_dtype: LogitDtype = "float32"
    dump_rows_per_shard: int = Field(256, gt=0)
    dump_temperature: float = Field(1.0, gt=0.0)
    dump_batch_rows: int = Field(8, gt=0)  # examples per teacher pass
    # On-policy: `sampled` trains advantage_t = -(log q(x_t) - log p(x_t)) (+ reward_weight * a task reward's group
    # advantage) with the policy-gradient update; `gkd` trains `loss` (with beta, top_k, temperature, alpha) on the
    # batch with the teacher in the step (TRL's GKD), where lmbda < 1 makes that share of steps on-policy and the
    # rest train on the dataset's completions (`completion_template`, formatted with each prompt row).
    on_policy_loss: OnPolicyLoss = "sampled"
    reward_weight: float = Field(0.0, ge=0.0)
    lmbda: float = Field(1.0, ge=0.0, le=1.0)
    completion_template: str = " {answer}"

    @model_validator(mode="after")
    def _check_schedules(self) -> DistillConfig:
        for name in SCHEDULED:
            if getattr(self, f"{name}_schedule") != "constant" and getattr(self, f"{name}_end") is None:
                raise ValueError(
                    f"distill.{name}_schedule={getattr(self, f'{name}_schedule')} goes from distill.{name} to "
                    f"distill.{name}_end: set it"
                )
        if self.teacher_placement == "actor" and (self.regime != "online" or self.top_k == 0):
            raise ValueError(
                f"distill.teacher_placement=actor answers each batch with the teacher's top-k over Ray: it needs "
                f"distill.regime=online (not {self.regime}) and distill.top_k > 0 (not {self.top_k}; the whole "
                f"vocabulary would move [tokens, vocab] floats between processes)"
            )
        if self.feature_layers and self.teacher_placement == "actor":
            raise ValueError(
                "distill.feature_layers reads the teacher's hidden states in the train step: it needs "
                "distill.teacher_placement=beside"
            )
        weighted = self.feature_weight > 0 or (self.feature_weight_end or 0) > 0
        if self.feature_layers and self.regime != "online":
            raise ValueError(
                f"distill.feature_layers compares the teacher's hidden states, which only the online regime has "
                f"(distill.regime={self.regime}): use distill.regime=online"
            )
        if bool(self.feature_layers) != weighted:
            raise ValueError(
                "distill.feature_layers and a distill.feature_weight above 0 go together: "
                + ("set distill.feature_weight" if self.feature_layers else "set distill.feature_layers")
            )
        return self

    def at(self, name: str) -> tuple[float, float, Schedule]:
        """(start, end, schedule) of one of `SCHEDULED`."""
        start = getattr(self, name)
        end = getattr(self, f"{name}_end")
        return start, start if end is None else end, getattr(self, f"{name}_schedule")


# ---------------------------------------------------------------------------- ppo


class PPOConfig(Section):
    """`ppo`: PPO with a critic (`posttrain.ppo`, docs/ppo.md); the policy's clipped objective is `rl.loss`'s."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)  # GAE's discount over a completion's tokens
    lam: float = Field(0.95, ge=0.0, le=1.0)  # GAE's lambda
    value_clip: float | None = Field(0.2, gt=0.0)  # the clipped value loss's range around the old values; None: off
    critic_learning_rate: float | None = Field(None, gt=0.0)  # None: optim.learning_rate (the same schedule)
    critic_warmup_steps: int = Field(0, ge=0)  # the first steps train the critic alone
    whiten_advantages: bool = True  # advantages normalised over the step's tokens (verl, OpenRLHF)
    # The critic's backbone from its own checkpoint (a causal LM: an HF directory, a Hub id or a Temper run, with
    # its own shape; verl's critic.model.path), trained whole, with a new value head; None: a copy of the policy.
    critic_init_from: str | None = None


# ------------------------------------------------------------------------- root


class PostTrainConfig(Config):
    """A post-training job: the core sections, and the sections the methods read."""

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)

    def check_at_load(self, source: str) -> None:
        """The core's checks, and every reward function resolves (imported once: a typo fails at load)."""
        super().check_at_load(source)
        check_reward_functions(self.reward, source)
