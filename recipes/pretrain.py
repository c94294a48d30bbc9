"""Pretrain a decoder from scratch with the core engine: next-token loss over packed documents.

    python -m recipes.pretrain [CONFIG.yml] [key=value ...]
    python -m recipes.pretrain recipes/configs/pretrain_tiny.yml train.steps=50
    python -m recipes.pretrain recipes/configs/pretrain_tiny.yml train.compile_only=true \
        model.preset=llama3.1-8b mesh.fsdp=8 data.seq_len=2048     # memory analysis, no run

With `checkpoint.init_from` it continues from existing weights (continued
pretraining). Supervised fine-tuning on prompts and chats is `recipes.sft`,
on the same skeleton (`core/run.py`).

Textbook pretraining: AdamW, cosine schedule with warm-up, documents packed
with `segment_ids` so no token attends across a document boundary. When
`data.tokenizer_dir` is unset, a byte-level BPE tokenizer is trained on the
training text and saved in the run directory (the embedded default has no hub).
The run directory ends up with the resolved config, checkpoints, metrics
(JSONL + TensorBoard), a loss-curve PNG and a Hugging Face export.
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.config_loader import config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "pretrain_tiny.yml"


def main(argv: list[str]) -> int:
    cfg = config_from_argv(argv, DEFAULT_CONFIG)
    from core.pretrain import PRETRAINING
    from posttrain.fit import fit_or_compile

    result = fit_or_compile(cfg, PRETRAINING)  # here, or in a process group (placement.trainer_processes)
    if result is None:  # train.compile_only
        return 0
    print(
        f"done: {result.steps} steps; run directory {result.run_dir} (config.yaml, checkpoints/, metrics.jsonl, "
        f"tensorboard/, loss.png, hf/)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.pretrain", supervise=True))
