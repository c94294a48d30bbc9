"""A training process for the resume tests: the pretraining setup plus a log of example ids per step.

python tests/train_worker.py IDS_FILE TOKENIZER_DIR [key=value ...]
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.config_loader import config_from_argv
from core.data import load_records, make_pipeline
from core.loop import Trainer
from core.mesh import make_mesh
from core.models import create_model
from core.objectives import next_token_loss


def main(ids_file: str, tokenizer_dir: str, overrides: list[str]) -> None:
    cfg = config_from_argv(overrides, "recipes/configs/pretrain_tiny.yml")
    records = load_records(cfg.data.source, cfg.data)
    mesh = make_mesh(cfg.mesh)
    model = create_model(cfg.model, mesh, seed=cfg.run.seed)
    data = make_pipeline(cfg.data, cfg.train.batch_size, records=records, tokenizer_dir=tokenizer_dir)

    def record_ids(step, batch):
        ids = sorted({int(i) for i in batch["example_ids"].ravel() if i >= 0})
        with open(ids_file, "a") as f:
            f.write(json.dumps({"step": step, "ids": ids}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    Trainer(cfg, model, next_token_loss, data, mesh=mesh, tokenizer_dir=tokenizer_dir, on_batch=record_ids).fit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
