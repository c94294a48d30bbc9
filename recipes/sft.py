"""Supervised fine-tuning on prompt/completion or chat rows, loss on the completion / assistant turns only.

    python -m recipes.sft [CONFIG.yml] [key=value ...]
    python -m recipes.sft recipes/configs/sft_tiny.yml checkpoint.init_from=runs/pretrain_tiny
    python -m recipes.sft recipes/configs/sft_tiny.yml data.source=chats.jsonl data.tokenizer_dir=/models/qwen

Rows are `{"messages": [{"role": ..., "content": ...}, ...]}` (`data.format=chat`, rendered with the
tokenizer's own chat template) or `{"prompt": ..., "completion": ...}` (`data.format=prompt_completion`);
see docs/sft.md for the masks, packing, evaluation and every config key. The run directory gets the
resolved config, checkpoints (a restart resumes), metrics, a loss plot, held-out greedy generations
(generations.jsonl) and a Hugging Face export (hf/).
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "sft_tiny.yml"


def main(argv: list[str]) -> int:
    from posttrain.config import PostTrainConfig
    from posttrain.fit import fit_or_compile
    from posttrain.sft import SFT

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    result = fit_or_compile(cfg, SFT)  # here, or in a process group (placement.trainer_processes)
    if result is None:  # train.compile_only
        return 0
    print(
        f"done: {result.steps} steps; run directory {result.run_dir} (config.yaml, checkpoints/, metrics.jsonl, "
        f"loss.png, generations.jsonl, hf/)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.sft", supervise=True))
