"""One entry for every method: `fit(cfg, method)` trains it to `train.steps`, resuming from `run.run_dir`.

    summary = fit(cfg, SFT)       # a dataset's batches: python -m recipes.sft CONFIG.yml
    summary = fit(cfg, GRPO)      # the samplers' batches: python -m recipes.grpo CONFIG.yml

A method whose batches come from the samplers (`posttrain.onpolicy.method.SamplingMethod`: GRPO, online DPO,
on-policy distillation) runs in the on-policy run (`posttrain.onpolicy.run.OnPolicyRun`: samplers, rewards, the
trainer, weight sync), whose workers are released however it ends; any other trains on its dataset
(`posttrain.offline`: in this process or as a JAX process group of Ray actors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.method import Method


@dataclass
class RunSummary:
    """What a finished run reports: its directory, the steps taken, the policy version (steps trained), the last
    held-out evaluation of an on-policy run and the Hugging Face export."""

    run_dir: Path
    steps: int
    policy_version: int
    final_eval: dict | None
    hf_dir: Path | None


def fit(cfg: Any, method: Method) -> RunSummary:
    """Train `method` to `train.steps` (module docstring)."""
    from posttrain.onpolicy.method import SamplingMethod

    if isinstance(method, SamplingMethod):
        from posttrain.onpolicy.run import OnPolicyRun, run_to_end

        return run_to_end(OnPolicyRun(cfg, method))
    from posttrain.offline import fit_offline

    return fit_offline(cfg, method)
