"""A training process for the resume tests: pretraining or SFT (by `data.format`), or offline distillation with
`--distill` (`core.run.build_run`), plus a log of example ids (source rows) per step.

python tests/train_worker.py IDS_FILE TOKENIZER_DIR [--distill] [key=value ...]
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.config_loader import config_from_argv
from core.run import build_run


def main(ids_file: str, tokenizer_dir: str, overrides: list[str]) -> None:
    flag = overrides[0] if overrides[:1] == ["--distill"] else None
    base = "recipes/configs/distill_tiny.yml" if flag else "recipes/configs/pretrain_tiny.yml"
    argv = [*overrides[flag is not None :], f"data.tokenizer_dir={tokenizer_dir}"]

    def record_ids(step, data):
        ids = sorted({int(i) for i in data.example_ids.ravel() if i >= 0})
        with open(ids_file, "a") as f:
            f.write(json.dumps({"step": step, "ids": ids}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    from core.pretrain import PRETRAINING
    from posttrain.config import PostTrainConfig
    from posttrain.distill.method import DISTILL
    from posttrain.sft import SFT

    cfg = config_from_argv(argv, base, schema=PostTrainConfig)
    method = DISTILL if flag else (PRETRAINING if cfg.data.format == "text" else SFT)
    run = build_run(cfg, method)
    run.loop.on_batch = record_ids
    run.fit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
