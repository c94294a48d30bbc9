"""What the on-policy run checks: the config before a Ray cluster or an engine starts, and each step's staleness.

Each method adds its own (`SamplingMethod.check`); what several methods share is here once (`check_graded_groups`).
"""

from __future__ import annotations

from core.config import ModelConfig
from core.config_loader import ConfigError
from posttrain.config import PostTrainConfig
from rollout.sampler import Completion


def check_config(cfg: PostTrainConfig) -> None:
    """What every on-policy method needs of several sections at once, checked before a Ray cluster or an engine
    starts."""
    rl, rollout, batch = cfg.rl, cfg.rollout, cfg.rl.batch
    if rollout.max_tokens >= rollout.max_model_len:
        raise ConfigError(
            f"rollout.max_tokens ({rollout.max_tokens}) must be < rollout.max_model_len "
            f"({rollout.max_model_len}): a prompt needs at least one token of the model length"
        )
    if rl.off_policy_steps and rollout.sampler != "vllm":
        raise ConfigError(
            f"rl.off_policy_steps={rl.off_policy_steps} (async) needs rollout.sampler=vllm: "
            f"the JAX sampler shares the trainer's process"
        )
    if cfg.placement.trainer_processes > 1 and rollout.sampler != "vllm":
        raise ConfigError(
            f"placement.trainer_processes={cfg.placement.trainer_processes} (a trainer process group on Ray) needs "
            f"rollout.sampler=vllm: the JAX sampler shares a single trainer process's devices"
        )
    if batch.pack_length and batch.pack_length < rollout.max_model_len:
        raise ConfigError(
            f"rl.batch.pack_length ({batch.pack_length}) < rollout.max_model_len "
            f"({rollout.max_model_len}): a full-length sequence would not fit in a row"
        )
    if cfg.data.source is None:
        raise ConfigError("data.source is not set: an on-policy method needs prompts")
    if rl.router_replay == "replay" and rl.agent is not None:
        raise ConfigError(
            "rl.router_replay=replay is built for single-turn completions; with rl.agent an episode's turns would "
            "need their routes joined, which is not built"
        )
    if rl.router_replay == "replay" and rollout.sampler == "vllm" and not rollout.record_routes:
        raise ConfigError(
            "rl.router_replay=replay with rollout.sampler=vllm needs rollout.record_routes=true: the vLLM sampler "
            "returns each token's experts only when it records them (rollout/vllm_routes.py)"
        )


def check_policy(cfg: PostTrainConfig, model: ModelConfig) -> None:
    """What the config needs of the policy the trainer holds (`model`: its model section, a checkpoint's when
    `checkpoint.init_from` names one), checked once the trainer has it, before any sampler starts."""
    if cfg.rl.router_replay == "replay" and model.moe is None:
        raise ConfigError(
            f"rl.router_replay=replay, but the policy (family {model.family!r}) is dense: it has no experts to "
            "replay routes on"
        )


def check_graded_groups(cfg: PostTrainConfig, why: str) -> None:
    """What a method that grades groups of samples needs (GRPO, online DPO): reward functions, and at least two
    samples a prompt (`why` says what the method does with them and ends with its subject, "it")."""
    if cfg.rl.batch.num_generations < 2:
        raise ConfigError(f"{why} needs rl.batch.num_generations >= 2, not {cfg.rl.batch.num_generations}")
    if not cfg.reward.functions and cfg.rl.agent is None:  # an environment's rewards are rewards too
        raise ConfigError(f"{why} needs reward.functions (at least one reward function to score completions)")


def check_tokenizer_template(tokenizer_dir: str, use_chat_template: bool) -> None:
    """`rl.use_chat_template=true` needs a tokenizer that has a chat template."""
    if not use_chat_template:
        return
    from core.data import load_tokenizer

    if not load_tokenizer(tokenizer_dir).chat_template:
        raise ConfigError(
            f"rl.use_chat_template=true, but the tokenizer in {tokenizer_dir} has no chat template: set "
            f"rl.use_chat_template=false (prompts are rl.prompt_template as it is) or use a tokenizer with one"
        )


class StalenessError(RuntimeError):
    """A completion older than `rl.off_policy_steps` policy versions reached the trainer."""


def check_staleness(completions: list[Completion], trainer_version: int, bound: int) -> int:
    """The largest staleness in the batch; raises if it exceeds `bound`. A completion that holds no token (an episode
    that failed before its first turn) was never sampled, so it has no policy version to be stale by."""
    worst = max([trainer_version - c.policy_version for c in completions if c.token_ids], default=0)
    if worst > bound:
        raise StalenessError(
            f"a completion from policy version {trainer_version - worst} reached the trainer at "
            f"version {trainer_version}: {worst} > rl.off_policy_steps={bound}"
        )
    return worst
