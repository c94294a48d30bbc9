"""Preference optimisation (DPO and its family) on a dataset of chosen / rejected pairs.

    python -m recipes.dpo [CONFIG.yml] [key=value ...]
    python -m recipes.dpo recipes/configs/dpo_tiny.yml checkpoint.init_from=runs/sft_tiny
    python -m recipes.dpo recipes/configs/dpo_tiny.yml dpo.loss_type=ipo dpo.precompute_ref_logps=true
    python -m recipes.dpo recipes/configs/dpo_online_tiny.yml       # online: pairs from the policy's own samples

Rows are `{"prompt": ..., "chosen": ..., "rejected": ...}` strings (`data.format=prompt_completion`) or chat
messages (`data.format=chat`: `prompt` a list of messages, `chosen` / `rejected` one assistant message each);
see docs/dpo.md for the losses, the reference (live or precomputed), metrics and every config key. The run
directory gets the resolved config, checkpoints (a restart resumes), metrics with held-out preference
accuracy, a loss plot and a Hugging Face export (hf/).
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.compile_only import refuse
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "dpo_tiny.yml"


def main(argv: list[str]) -> int:
    from posttrain.config import PostTrainConfig

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    if cfg.dpo.online:
        refuse(
            cfg,
            "online DPO (it starts samplers and a Ray cluster)",
            "compile its update with dpo.online=false (the same preference objective on pairs of data.seq_len)",
        )
        from posttrain.dpo.online import ONLINE_DPO
        from posttrain.fit import fit

        summary = fit(cfg, ONLINE_DPO)
        print(f"done: {summary.steps} steps; run directory {summary.run_dir} (metrics.jsonl, reward.png, hf/)")
        return 0
    from posttrain.dpo.offline import DPO
    from posttrain.fit import fit_or_compile

    result = fit_or_compile(cfg, DPO)  # here, or in a process group (placement.trainer_processes)
    if result is None:  # train.compile_only
        return 0
    print(f"done: run directory {result.run_dir} (config.yaml, checkpoints/, metrics.jsonl, loss.png, hf/)")
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.dpo", supervise=True))
