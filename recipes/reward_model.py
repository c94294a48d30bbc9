"""A Bradley-Terry reward model on a dataset of chosen / rejected pairs (DPO's rows), exported for transformers.

    python -m recipes.reward_model [CONFIG.yml] [key=value ...]
    python -m recipes.reward_model recipes/configs/reward_model_tiny.yml checkpoint.init_from=runs/sft_tiny
    python -m recipes.reward_model recipes/configs/reward_model_tiny.yml reward_model.margin=0.5

Rows are DPO's (`{"prompt", "chosen", "rejected"}` strings, or chat messages with `data.format=chat`); see
docs/reward_models.md for the loss, the metrics and how an on-policy method scores completions with the result.
The run directory gets the resolved config, checkpoints (a restart resumes), metrics with held-out accuracy, a loss
plot, and hf/reward_model: a `...ForSequenceClassification` directory `transformers` reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "reward_model_tiny.yml"


def main(argv: list[str]) -> int:
    from posttrain.config import PostTrainConfig
    from posttrain.fit import fit_or_compile
    from posttrain.reward_model import REWARD_MODEL

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    result = fit_or_compile(cfg, REWARD_MODEL)  # here, or in a process group (placement.trainer_processes)
    if result is None:  # train.compile_only
        return 0
    print(f"done: run directory {result.run_dir} (metrics.jsonl, loss.png, hf/reward_model)")
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.reward_model", supervise=True))
