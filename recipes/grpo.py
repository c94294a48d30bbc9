"""GRPO / GSPO (and the DAPO, Dr.GRPO, RLOO variants) on a prompt dataset with reward-function plugins.

    python -m recipes.grpo [CONFIG.yml] [key=value ...]
    python -m recipes.grpo recipes/configs/grpo_tiny.yml rl.batch.num_generations=8
    python -m recipes.grpo recipes/configs/grpo_tiny.yml rl.algorithm=gspo rl.loss.loss_agg=sequence-mean-token-mean
    python -m recipes.grpo recipes/configs/grpo_tiny.yml rl.off_policy_steps=1     # async

The textbook GRPO step (Shao et al., 2024) with the choices of docs/grpo.md:
group-normalised advantages, PPO clipping, token-mean loss, no KL unless
`rl.loss.beta > 0`, and truncated importance sampling against the sampler's
log-probs. The policy starts from `checkpoint.init_from` (an HF directory or a
Temper checkpoint) or, without one, from a random init with a tokenizer
trained on the prompts (the tiny CI config). Inside `ray job submit` it
attaches to the running cluster; otherwise it starts a local one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_tiny.yml"


def main(argv: list[str]) -> int:
    from posttrain.config import PostTrainConfig

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    from posttrain.fit import fit_or_compile
    from posttrain.grpo import GRPO

    summary = fit_or_compile(cfg, GRPO)
    if summary is None:  # train.compile_only
        return 0
    print(
        f"done: {summary.steps} steps, policy version {summary.policy_version}; run directory {summary.run_dir}"
        + (f"; final eval {summary.final_eval}" if summary.final_eval else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.grpo", supervise=True))
