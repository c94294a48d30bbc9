"""The on-policy methods' sections: `rl.batch`, `rl.loss`, `rl.rollout_correction`, `rl.advantage`, `rl.agent` and
`rl` itself (re-exported by `posttrain.config`, where `PostTrainConfig` holds them; docs/grpo.md, docs/config.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from core.config import Section
from posttrain.advantages import ESTIMATORS, Aggregation
from posttrain.losses.correction import known_modes
from posttrain.losses.kl import KLEstimator
from posttrain.losses.policy import Algorithm, LossAgg
from posttrain.losses.surrogates import POLICY_LOSSES
from rewards.registry import BUILTIN_CHECKS

# The GSPO paper's clip range (Zheng et al., 2025, section 5.1): sequence ratios stay within ~1e-3 of 1.
GSPO_EPSILON, GSPO_EPSILON_HIGH = 3e-4, 4e-4
GMPO_EPSILON = 0.4  # the GMPO paper's token clip range, in log space: ratios within exp(-/+0.4)


def known(value: str, names: Iterable[str], key: str) -> str:
    """`value`, a name of a registry (`names`); else a ValueError naming `key` and the names it knows."""
    names = list(names)
    if value not in names:
        raise ValueError(f"unknown {key} {value!r}; known: {', '.join(names)}")
    return value


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
    # Adaptive entropy control: the coefficient moved by `entropy_coef_delta` a step toward `entropy_target`, within
    # `entropy_coef_range` [lo, hi] (posttrain/losses/entropy_control.py); None: a fixed coefficient.
    entropy_target: float | None = Field(None, gt=0.0)
    entropy_coef_range: tuple[float, float] | None = None
    entropy_coef_delta: float = Field(0.005, gt=0.0)
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
        return known(value, POLICY_LOSSES, "rl.loss.type")

    @model_validator(mode="after")
    def _entropy_control(self) -> RLLossConfig:
        if self.entropy_target is not None and self.entropy_coef_range is None:
            raise ValueError(
                f"rl.loss.entropy_target={self.entropy_target} needs rl.loss.entropy_coef_range: [lo, hi], the range "
                "the coefficient moves in"
            )
        if self.entropy_coef_range is not None:
            lo, hi = self.entropy_coef_range
            if not 0 <= lo <= hi:
                raise ValueError(f"rl.loss.entropy_coef_range={[lo, hi]}: needs 0 <= lo <= hi")
            if self.entropy_target is None:
                why = "rl.loss.entropy_coef_range moves the coefficient toward rl.loss.entropy_target"
                raise ValueError(f"{why}: set one")
        return self

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

    @field_validator("mode", mode="before")
    @classmethod
    def _known(cls, value: object) -> str:
        if value is False:  # YAML 1.1 reads a bare `off` as false: `mode: off` means the mode off
            value = "off"
        if not isinstance(value, str):
            raise ValueError(f"rl.rollout_correction.mode={value!r}: a name, one of {', '.join(known_modes())}")
        return known(value, known_modes(), "rl.rollout_correction.mode")

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
        return known(value, ESTIMATORS, "rl.advantage.estimator")

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
    # None: `tools` (without a program). A class written for TRL's environment_factory runs through its adapter. A
    # mapping {name: spec} of any of these: each row chooses one by its `environment` column (TRL's field), with only
    # that environment's tools offered (environment_kwargs then go under each name, beside `column`).
    environment: str | dict[str, str] | None = None
    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    tool_parser: str = "hermes"  # vLLM's parser for the family's tool calls (hermes: Qwen2.5 / Qwen3)
    # vLLM's reasoning parser (qwen3, deepseek_r1, ...): the endpoint returns a reply's reasoning in `reasoning`, apart
    # from its content, as vLLM's server does with --reasoning-parser (rollout/reasoning.py). None: all in content.
    reasoning_parser: str | None = None
    max_turns: int = Field(4, gt=0)  # assistant turns a trajectory may take
    env_timeout_s: float = Field(30.0, gt=0.0)  # the longest one reset or step may take
    # Per-turn rewards from the environment, summed with this discount (1: a plain sum) and added to the reward
    # functions' score of the final answer.
    discount: float = Field(1.0, ge=0.0, le=1.0)
    # Episodes running at once (None: every episode of the step). With vLLM each runs on its own: its next turn is a
    # new request as soon as the environment answered, beside the other episodes' turns (continuous batching).
    max_concurrency: int | None = Field(None, gt=0)
    # An episode that failed outside the model (its environment's reset failed, a step hung or killed its worker;
    # an agent program or command timed out, or the endpoint's sampler failed its call) is started again from its
    # row this many times before it fails: dropping it would bias its group's baseline.
    retries: int = Field(1, ge=0)
    # An agent written against an OpenAI client in place of an environment (rollout/agent_program.py): a coroutine
    # `async def run(row, client)` named as reward functions are; each episode under `program_timeout_s`.
    program: str | None = None
    # Or a command run per episode (rollout/agent_program.py CommandRunner): the row as JSON on stdin,
    # OPENAI_BASE_URL set to the episode's base URL, its reward the last line it prints (JSON). Split as a shell
    # would split it, never run by one. Under program_timeout_s too.
    command: str | None = None
    program_timeout_s: float = Field(300.0, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _one_driver(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        drivers = [k for k in ("program", "command") if data.get(k) is not None]
        if not drivers and data.get("reasoning_parser") is not None:
            raise ValueError(
                "rl.agent.reasoning_parser splits the replies of the endpoint an agent program or command calls: set "
                "rl.agent.program or command, or leave it unset"
            )
        if not drivers:
            return {**data, "environment": data.get("environment") or "tools"}
        if len(drivers) > 1:
            raise ValueError("rl.agent.program and rl.agent.command are two ways to run the agent: set one")
        if data.get("environment") is not None or data.get("environment_kwargs"):
            raise ValueError(
                f"rl.agent.{drivers[0]} drives the episodes itself: leave rl.agent.environment and environment_kwargs "
                "unset"
            )
        return data

    @property
    def runs_agents(self) -> bool:
        """Whether the episodes are an agent's (a program or a command) against the endpoint, not an environment's."""
        return self.program is not None or self.command is not None


# The objectives that read none of clip's settings (epsilon, epsilon_high, dual_clip), and what they read instead.
OWN_PARAMETERS = {
    "cispo": "rl.loss.cispo_cap",
    "sapo": "rl.loss.sapo_tau_pos, rl.loss.sapo_tau_neg",
    "dppo": "rl.loss.dppo_delta, rl.loss.dppo_cap",
}


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
    def _dppo_weighs_once(self) -> RLConfig:
        if self.loss.type == "dppo" and self.rollout_correction.mode != "off":
            raise ValueError(
                f"rl.loss.type=dppo weighs each token by its ratio to the sampler already: "
                f"rl.rollout_correction.mode={self.rollout_correction.mode} would weigh it twice (leave it off)"
            )
        return self

    @model_validator(mode="after")
    def _parameters_it_reads(self) -> RLConfig:
        """A clip setting the objective does not read is refused, not ignored (TRL's CISPO takes its cap from
        epsilon_high; here it is rl.loss.cispo_cap). The filled-in defaults pass: a config read back is not refused."""
        loss, gspo = self.loss, self.algorithm == "gspo"
        if loss.type in OWN_PARAMETERS:
            epsilon = GSPO_EPSILON if gspo else 0.2
            high = GSPO_EPSILON_HIGH if gspo and loss.epsilon == GSPO_EPSILON else loss.epsilon
            given = [("epsilon", loss.epsilon, epsilon), ("epsilon_high", loss.epsilon_high, high)]
            unread = [f"rl.loss.{k}={v}" for k, v, default in given if v != default]
            unread += [f"rl.loss.dual_clip={loss.dual_clip}"] if loss.dual_clip is not None else []
            if unread:
                raise ValueError(
                    f"rl.loss.type={loss.type} does not read {', '.join(unread)}; its own: {OWN_PARAMETERS[loss.type]}"
                )
        if loss.type == "gmpo" and loss.loss_agg != "sequence-mean-token-mean":
            raise ValueError(
                f"rl.loss.type=gmpo is one value a sequence (its geometric mean): rl.loss.loss_agg={loss.loss_agg} "
                "would weigh sequences by their length; leave it sequence-mean-token-mean"
            )
        return self

    @model_validator(mode="after")
    def _ratio_level(self) -> RLConfig:
        if self.algorithm == "gspo" and self.loss.type in ("cispo", "gmpo", "dppo"):
            raise ValueError(
                f"rl.loss.type={self.loss.type} takes the per-token ratio (its own sequence form, for gmpo): it "
                "cannot be combined with rl.algorithm=gspo; use rl.algorithm=grpo"
            )
        return self

    @field_validator("accuracy_fn")
    @classmethod
    def _by_name_alone(cls, value: str | None) -> str | None:
        if value in BUILTIN_CHECKS:  # a built-in that needs its kwargs (a model's path, a judge's template)
            raise ValueError(
                f"rl.accuracy_fn={value} needs its kwargs, which rl.accuracy_fn cannot give (it names a function "
                "alone): use math_verify, reasoning_gym or a plugin; score with it through reward.functions"
            )
        return value

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
