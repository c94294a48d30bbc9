"""PPO with a critic (GAE advantages, the clipped value loss) on a prompt dataset with reward-function plugins.

    python -m recipes.ppo [CONFIG.yml] [key=value ...]
    python -m recipes.ppo recipes/configs/ppo_tiny.yml ppo.critic_warmup_steps=2 ppo.critic_learning_rate=1e-3
    python -m recipes.ppo recipes/configs/ppo_tiny.yml rollout.sampler=jax model.lora.rank=8

The sampling, rewards, weight sync, clipped policy objective and checkpoints are GRPO's (docs/grpo.md); what is
PPO's (docs/ppo.md): a critic (a copy of the policy, or `ppo.critic_init_from`'s model, with a value head, trained
beside it), GAE over each
completion's tokens, the clipped value loss, the critic's learning rate and warm-up, and its export apart
(`run_dir/hf/critic`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "ppo_tiny.yml"


def main(argv: list[str]) -> int:
    from core.compile_only import refuse
    from posttrain.config import PostTrainConfig

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    refuse(cfg, "PPO (it starts samplers)", "compile GRPO's update (python -m recipes.grpo train.compile_only=true)")
    from posttrain.fit import fit
    from posttrain.ppo import PPO

    summary = fit(cfg, PPO)
    print(
        f"done: {summary.steps} steps, policy version {summary.policy_version}; run directory {summary.run_dir} "
        f"(hf/, hf/critic/)" + (f"; final eval {summary.final_eval}" if summary.final_eval else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.ppo", supervise=True))
