"""The post-training methods' config: the core sections plus `rollout`, `reward`, `rl`, `sft`, `dpo`, `distill`.

    cfg = load_config("recipes/configs/grpo_tiny.yml", overrides, schema=PostTrainConfig)

Each section is one pydantic model, closed (unknown keys fail with the dotted key that exists) and validated on
its own. What a method needs of several sections at once is checked by the method when its run is built
(`posttrain.sft.check_config`, `posttrain.dpo.offline.check_config`, `posttrain.onpolicy.checks.check_config`,
`posttrain.grpo.check_config`, ...), before any work starts: an SFT job never fails on RL's checks. The values an
option may take are defined once, by the code that reads them (the loss modules' Literals), and imported here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from core.config import Config, Section
from core.kernels.divergence import Divergence
from posttrain.advantages import ESTIMATORS, Aggregation
from posttrain.losses.correction import known_modes
from posttrain.losses.distill import FeatureKind, Schedule, TopKMode
from posttrain.losses.kl import KLEstimator
from posttrain.losses.policy import Algorithm, LossAgg
from posttrain.losses.preference import SMOOTHED, LossType
from posttrain.losses.surrogates import POLICY_LOSSES
from rewards.config import RewardConfig, check_reward_functions
from rollout.config import RolloutConfig

# ---------------------------------------------------------------------------- rl

# The GSPO paper's clip range (Zheng et al., 2025, section 5.1): sequence ratios stay within ~1e-3 of 1.
GSPO_EPSILON, GSPO_EPSILON_HIGH = 3e-4, 4e-4
GMPO_EPSILON = 0.4  # the GMPO paper's token clip range, in log space: ratios within exp(-/+0.4)


class RLBatchConfig(Section):
    """`rl.batch`: what one on-policy step samples and how it is cut into updates and packed rows."""

    prompts_per_step: int = Field(4, gt=0)
    # Completions per prompt (GRPO's group: >= 2, checked by GRPO; online DPO >= 2; one is allowed where a
    # method learns from a single sample, as on-policy distillation does).
    num_generations: int = Field(4, gt=0)
    num_iterations: int = Field(1, gt=0)  # mu: passes over each rollout batch
    mini_batches: int = Field(1, gt=0)  # optimizer updates per pass
    pack_sequences: bool = True  # several prompt + completion sequences per trainer row (less padding)
    share_prompts: bool = True  # packed: a prompt's completions share one copy of it (each prompt token trained once)
    pack_length: int = Field(0, ge=0)  # packed row length in tokens; 0 = the method's (rollout.max_model_len)
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill the batch
    max_sampling_rounds: int = Field(4, gt=0)


class RLLossConfig(Section):
    """`rl.loss`: the policy objective (`type`, a name of `posttrain.losses.surrogates`), its parameters, its
    aggregation and the KL term (posttrain/losses)."""

    type: str = "clip"  # clip (PPO / GRPO / DAPO), cispo, sapo, gmpo, dppo
    epsilon: float = Field(0.2, ge=0.0)  # clip: the ratio's range 1 -/+ epsilon; gmpo: the log ratio's
    epsilon_high: float = Field(0.2, ge=0.0)  # DAPO clip-higher: > epsilon
    dual_clip: float | None = Field(None, gt=1.0)
    cispo_cap: float = Field(5.0, gt=0.0)  # cispo: the detached weight's upper bound (TRL's epsilon_high for cispo)
    sapo_tau_pos: float = Field(1.0, gt=0.0)  # sapo: the gate's temperature where the advantage is positive
    sapo_tau_neg: float = Field(1.05, gt=0.0)  # ... and where it is not
    dppo_delta: float = Field(0.15, gt=0.0)  # dppo: how far a token's probability may move from the sampler's
    dppo_cap: float = Field(20.0, gt=0.0)  # dppo: the detached ratio's upper bound
    entropy_coef: float = Field(0.0, ge=0.0)  # the entropy bonus: loss -= coef * the mean entropy (TRL's)
    loss_agg: LossAgg = "token-mean"
    mask_truncated: bool = False  # DAPO: completions cut at max_tokens add no policy-loss tokens
    beta: float = Field(0.0, ge=0.0)  # KL coefficient; 0 loads no reference model
    kl_estimator: KLEstimator = "k3"
    # The KL term on every completion token (zero-variance groups and truncated completions too, as TRL
    # and verl); false: only where the policy term applies (Temper before 2026-11).
    kl_every_token: bool = True

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        if isinstance(data, dict) and "tis_cap" in data:
            cap = data["tis_cap"]
            now = "mode: off" if cap is None else f"mode: token_truncate, hi: {cap}"
            raise ValueError(
                f"rl.loss.tis_cap is now rl.rollout_correction (docs/grpo.md): write rl.rollout_correction={{{now}}}"
            )
        return data

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in POLICY_LOSSES:
            raise ValueError(f"unknown rl.loss.type {value!r}; known: {', '.join(POLICY_LOSSES)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> RLLossConfig:
        if self.epsilon_high < self.epsilon:
            raise ValueError(f"rl.loss.epsilon_high ({self.epsilon_high}) must be >= rl.loss.epsilon ({self.epsilon})")
        return self


class RolloutCorrectionConfig(Section):
    """`rl.rollout_correction`: the sampler / trainer mismatch's importance weight (posttrain/losses/correction.py):
    its level and action (`mode`) and bounds. The mode defaults by objective: token_truncate (GSPO:
    geometric_truncate, its own ratio's level; DPPO: off, its objective weighs by the sampler's ratio already)."""

    mode: str = "token_truncate"  # off, {token,sequence,geometric}_{truncate,mask}
    lo: float | None = Field(None, ge=0.0)  # None: no lower bound
    hi: float | None = Field(2.0, gt=0.0)  # None: no upper bound

    @field_validator("mode")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in known_modes():
            raise ValueError(f"unknown rl.rollout_correction.mode {value!r}; known: {', '.join(known_modes())}")
        return value

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ValueError(f"rl.rollout_correction.lo ({self.lo}) must be <= rl.rollout_correction.hi ({self.hi})")
        return self


class AdvantageConfig(Section):
    """`rl.advantage`: how a group's rewards become advantages (posttrain/advantages.py)."""

    estimator: str = "group_norm"  # group_norm, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline
    std_eps: float = Field(1e-4, gt=0.0)  # group_norm: (r - mean) / (std + std_eps), as TRL; the batch whitening's
    # How the named rewards meet: summed, then the estimator (default); or each normalised in its group, summed and
    # whitened over the batch (GDPO, TRL's normalize_then_sum).
    aggregation: Aggregation = "sum_then_normalize"

    @field_validator("estimator")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in ESTIMATORS:
            raise ValueError(f"unknown rl.advantage.estimator {value!r}; known: {', '.join(ESTIMATORS)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        if self.aggregation == "normalize_then_sum" and self.estimator != "group_norm":
            raise ValueError(
                f"rl.advantage.aggregation=normalize_then_sum normalises each reward in its group and whitens the sum "
                f"itself: rl.advantage.estimator={self.estimator} would not be used (leave it group_norm)"
            )
        return self


class AgentConfig(Section):
    """`rl.agent`: multi-turn rollouts, the model taking turns with an environment (docs/agents.md).

    The trajectory's budget is `rollout.max_model_len` (prompt and every turn), a turn's `rollout.max_tokens`."""

    # The environment plugin: `tools` (built-in: the model calls `environment_kwargs.tools`), package.module:Class,
    # path/to/file.py:Class, or an entry point of `temper.environments`.
    environment: str = "tools"
    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    tool_parser: str = "hermes"  # vLLM's parser for the family's tool calls (hermes: Qwen2.5 / Qwen3)
    max_turns: int = Field(4, gt=0)  # assistant turns a trajectory may take
    env_timeout_s: float = Field(30.0, gt=0.0)  # the longest one reset or step may take
    # Per-turn rewards from the environment, summed with this discount (1: a plain sum) and added to the reward
    # functions' score of the final answer.
    discount: float = Field(1.0, ge=0.0, le=1.0)
    # Episodes running at once (None: every episode of the step). With vLLM each runs on its own: its next turn is a
    # new request as soon as the environment answered, beside the other episodes' turns (continuous batching).
    max_concurrency: int | None = Field(None, gt=0)


class RLConfig(Section):
    """The on-policy methods (GRPO / GSPO and their variants, online DPO): `rl.batch`, `rl.loss`, `rl.advantage`,
    and the prompts, async bound and evaluation here (docs/grpo.md).

    `rl.loss.epsilon`, `epsilon_high` and `loss_agg` default by algorithm and objective: GRPO 0.2 / 0.2 /
    token-mean, GSPO 3e-4 / 4e-4 / sequence-mean-token-mean (the GSPO paper's), GMPO 0.4 / 0.4 (in log space) /
    sequence-mean-token-mean (the GMPO paper's); `rl.rollout_correction.mode` as its docstring says; a value given
    explicitly always wins.
    The policy starts from `checkpoint.init_from` (None: a random init, for tests).
    """

    algorithm: Algorithm = "grpo"
    prompt_template: str = "{question}"  # formatted with each dataset row
    use_chat_template: bool = False
    batch: RLBatchConfig = Field(default_factory=RLBatchConfig)
    loss: RLLossConfig = Field(default_factory=RLLossConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    off_policy_steps: int = Field(0, ge=0)  # async: completions at most this many versions old
    # The reward function that defines "correct" (value > 0) for accuracy metrics and evaluation; None: none.
    accuracy_fn: str | None = "math_verify"
    eval_prompts: int = Field(64, gt=0)  # held-out prompts per evaluation (train.eval_every)
    eval_samples: int = Field(4, gt=0)  # sampled completions per prompt for pass@k / maj@k
    agent: AgentConfig | None = None  # multi-turn rollouts with an environment; None: one completion per sample
    # Routing replay (R3) for a mixture-of-experts policy: `replay` trains with the experts the sampler routed each
    # token to (gate weights from the trainer's router); `off` routes as the trainer's router does. Either way the
    # share of tokens routed differently is logged (moe/route_mismatch) when the sampler returns routes (the JAX
    # sampler always; vLLM with rollout.record_routes).
    router_replay: Literal["off", "replay"] = "off"

    @field_validator("router_replay", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _ratio_level(self) -> RLConfig:
        if self.algorithm == "gspo" and self.loss.type in ("cispo", "gmpo", "dppo"):
            raise ValueError(
                f"rl.loss.type={self.loss.type} takes the per-token ratio (its own sequence form, for gmpo): it "
                "cannot be combined with rl.algorithm=gspo; use rl.algorithm=grpo"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data):
        """Fill the clip range and aggregation the algorithm's paper uses where the user named none."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        loss = data.get("loss")
        if isinstance(loss, BaseModel):
            return data  # already built (a model_copy): its defaults were filled then
        loss = dict(loss or {})
        gspo, objective = data.get("algorithm") == "gspo", loss.get("type", "clip")
        if loss.get("epsilon") is None:
            loss["epsilon"] = GSPO_EPSILON if gspo else GMPO_EPSILON if objective == "gmpo" else 0.2
            if loss.get("epsilon_high") is None and gspo:
                loss["epsilon_high"] = GSPO_EPSILON_HIGH
        if loss.get("epsilon_high") is None:
            loss["epsilon_high"] = loss["epsilon"]
        if loss.get("loss_agg") is None:
            loss["loss_agg"] = "sequence-mean-token-mean" if gspo or objective == "gmpo" else "token-mean"
        data["loss"] = loss
        correction = data.get("rollout_correction")
        if not isinstance(correction, BaseModel):
            correction = dict(correction or {})
            if correction.get("mode") is None:
                level = "off" if objective == "dppo" else "geometric_truncate" if gspo else "token_truncate"
                correction["mode"] = level
            data["rollout_correction"] = correction
        return data


# ---------------------------------------------------------------------------- sft


class SFTConfig(Section):
    """Supervised fine-tuning (posttrain/sft.py; docs/sft.md)."""

    # Train only on assistant / completion tokens (prompt, system and user tokens masked out).
    completion_only_loss: bool = True
    # At each evaluation (train.eval_every): greedy completions of this many held-out prompts, logged to
    # run_dir/generations.jsonl (0: none).
    eval_generations: int = Field(4, ge=0)
    eval_max_new_tokens: int = Field(64, gt=0)


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
    distill: DistillConfig = Field(default_factory=DistillConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)

    def check_at_load(self, source: str) -> None:
        """The core's checks, and every reward function resolves (imported once: a typo fails at load)."""
        super().check_at_load(source)
        check_reward_functions(self.reward, source)
