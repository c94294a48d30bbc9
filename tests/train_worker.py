"""A training process for the resume tests: the supervised (pretraining / SFT) setup, or offline DPO with
`--dpo`, plus a log of example ids (source rows) per step.

python tests/train_worker.py IDS_FILE TOKENIZER_DIR [--dpo] [key=value ...]
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.config_loader import config_from_argv
from core.supervised import build_supervised


def main(ids_file: str, tokenizer_dir: str, overrides: list[str]) -> None:
    dpo = overrides[:1] == ["--dpo"]
    base = "recipes/configs/dpo_tiny.yml" if dpo else "recipes/configs/pretrain_tiny.yml"
    cfg = config_from_argv([*overrides[dpo:], f"data.tokenizer_dir={tokenizer_dir}"], base)

    def record_ids(step, data):
        ids = sorted({int(i) for i in data.example_ids.ravel() if i >= 0})
        with open(ids_file, "a") as f:
            f.write(json.dumps({"step": step, "ids": ids}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    if dpo:
        from posttrain.dpo_run import build_dpo

        run = build_dpo(cfg)
    else:
        run = build_supervised(cfg)
    run.trainer.on_batch = record_ids
    run.trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
