"""Teacher-student distillation: offline (from a dumped top-k), online (the teacher in the step) or on-policy
(the student samples, the teacher scores every token).

    python -m recipes.distill CONFIG.yml distill.regime=offline distill.logits_dir=runs/kd/topk
    python -m recipes.distill CONFIG.yml distill.regime=online distill.teacher=runs/teacher/hf distill.top_k=0
    python -m recipes.distill recipes/configs/grpo_tiny.yml distill.regime=on_policy distill.teacher=runs/teacher/hf

Offline and online train on SFT's rows (`data.*`); on-policy samples the prompts of `data.*` with the rollout
machinery GRPO uses (vLLM or JAX samplers on Ray). Losses, regimes, schedules and every config key:
docs/distillation.md. The run directory gets checkpoints (a restart resumes), metrics and an HF export (hf/).
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.compile_only import refuse
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "distill_tiny.yml"


def main(argv: list[str]) -> int:
    from posttrain.config import PostTrainConfig

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    refuse(
        cfg,
        "distillation (its step reads the teacher, which compile-only does not load)",
        "compile the student's SFT step (python -m recipes.sft train.compile_only=true) or its GRPO step",
    )
    if cfg.distill.regime == "on_policy":
        from posttrain.distill.onpolicy import ON_POLICY_DISTILL
        from posttrain.fit import fit

        summary = fit(cfg, ON_POLICY_DISTILL)
        print(f"done: {summary.steps} steps; run directory {cfg.run.run_dir}")
        return 0
    from posttrain.distill.method import DISTILL
    from posttrain.fit import fit

    result = fit(cfg, DISTILL)  # here, or in a process group (placement.trainer_processes)
    print(f"done: run directory {result.run_dir} (config.yaml, checkpoints/, metrics.jsonl, generations.jsonl, hf/)")
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.distill", supervise=True))
