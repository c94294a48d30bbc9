"""`reward.*`: the reward functions an on-policy method scores completions with (`rewards.runner`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from core.config import Section

# Built-ins whose deadline is not `reward.math_verify_timeout`, by their name and by their full spec.
BUILTIN_TIMEOUT_S = {"reward_model": 300.0, "rewards.model:reward_model": 300.0}


class RewardFn(Section):
    """One reward function: a built-in name, `package.module:function`, `path/file.py:function` or an entry point.

    Validation never imports it: a config read back from a run directory (a checkpoint) must not run
    code. `check_reward_functions` (run by `load_config`) resolves every function once, so a typo fails at load.
    """

    fn: str
    weight: float = 1.0
    kwargs: dict = Field(default_factory=dict)
    # Its own deadline per batch; None: the run's, `reward.math_verify_timeout`, or a built-in's own (the reward
    # model's first batch loads the model in each worker: a worker killed at a short deadline would load it again,
    # and fail, every batch).
    timeout_s: float | None = Field(None, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _builtin_deadline(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("timeout_s") is None and data.get("fn") in BUILTIN_TIMEOUT_S:
            return {**data, "timeout_s": BUILTIN_TIMEOUT_S[data["fn"]]}
        return data


class RewardConfig(Section):
    functions: list[RewardFn] = Field(default_factory=list)
    math_verify_timeout: float = Field(10.0, gt=0.0)
    math_verify_num_procs: int = Field(2, gt=0)
    # None: a completion a reward function failed on (raised, hung, NaN) drops its whole group from the loss.
    # A number: score such failures as that value instead (an explicit opt-in).
    failure_reward: float | None = None


def check_reward_functions(cfg: RewardConfig, source: str = "<config>") -> None:
    """Import every configured reward function once, so that a typo fails at load, not after a rollout.
    (Only at load: validating a config read back from a run directory never imports user code.)"""
    from core.config_loader import ConfigError
    from rewards.registry import BUILTIN_CHECKS, UnknownReward, resolve

    for i, fn in enumerate(cfg.functions):
        try:
            resolve(fn.fn)
        except UnknownReward as err:
            raise ConfigError(f"{source}: reward.functions[{i}].fn: {err}") from None
        if fn.fn in BUILTIN_CHECKS:  # a built-in that checks its kwargs (a reward model's directory)
            try:
                resolve(BUILTIN_CHECKS[fn.fn])(fn.kwargs)
            except ValueError as err:
                raise ConfigError(f"{source}: reward.functions[{i}] ({fn.fn}): {err}") from None
