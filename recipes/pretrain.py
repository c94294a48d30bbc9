"""Pretrain a decoder from scratch with the core engine: next-token loss over packed documents.

    python -m recipes.pretrain [CONFIG.yml] [key=value ...]
    python -m recipes.pretrain recipes/configs/pretrain_tiny.yml train.steps=50
    python -m recipes.pretrain recipes/configs/pretrain_tiny.yml train.compile_only=true \
        model.preset=llama3.1-8b mesh.fsdp=8 data.seq_len=2048     # memory analysis, no run

With `checkpoint.init_from` it fine-tunes existing weights instead, and with
`data.format=prompt_completion` only completion tokens carry loss (SFT), which
is how `recipes.quickstart` fine-tunes on formatted solutions.

Textbook pretraining: AdamW, cosine schedule with warm-up, documents packed
with `segment_ids` so no token attends across a document boundary. When
`data.tokenizer_dir` is unset, a byte-level BPE tokenizer is trained on the
training text and saved in the run directory (the embedded default has no hub).
The run directory ends up with the resolved config, checkpoints, metrics
(JSONL + TensorBoard), a loss-curve PNG and a Hugging Face export.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from core.cli import run_recipe
from core.config_loader import ConfigError, config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "pretrain_tiny.yml"


def main(argv: list[str]) -> int:
    cfg = config_from_argv(argv, DEFAULT_CONFIG)
    if cfg.train.compile_only:
        # Fake CPU devices stand in for the configured topology; this must precede JAX's first device query.
        from core.host_devices import request_host_devices

        request_host_devices(math.prod(v for v in cfg.mesh.axis_sizes().values() if v > 0))
    import jax

    from core.config import resolve_mesh_shape
    from core.mesh import make_mesh
    from core.objectives import next_token_loss

    try:  # fail early, with the sizes, on a bad mesh
        resolve_mesh_shape(cfg.mesh, jax.device_count())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mesh = make_mesh(cfg.mesh)
    if cfg.train.compile_only:
        from core.compile_only import compile_train_step

        compile_train_step(cfg, next_token_loss, mesh)
        return 0

    from core.data import load_records, make_pipeline
    from core.loop import Trainer
    from core.metrics import device_memory
    from core.models import create_model
    from core.models.summary import parameter_summary
    from core.tokenizer import tokenizer_for_run

    run_dir = Path(cfg.run.run_dir)
    records = load_records(cfg.data.source, cfg.data)
    texts = (r[cfg.data.text_field] for r in records if isinstance(r.get(cfg.data.text_field), str))
    tokenizer_dir = tokenizer_for_run(cfg.data.tokenizer_dir, texts, run_dir, cfg.model.vocab_size)

    if cfg.checkpoint.init_from is not None:
        from core.checkpoint import load_model_from

        with jax.set_mesh(mesh):
            model = load_model_from(cfg.checkpoint.init_from, mesh, dtype=cfg.model.param_dtype)
        cfg = cfg.model_copy(update={"model": model.cfg})  # the checkpoint decides the shape
        print(f"initialised from {cfg.checkpoint.init_from}")
    else:
        model = create_model(cfg.model, mesh, seed=cfg.run.seed)
    _check_vocab(cfg.model.vocab_size, tokenizer_dir)
    if cfg.mesh.debug_sharding:
        print(parameter_summary(model))
    print(device_memory() + " (after model init)")
    train = make_pipeline(
        cfg.data,
        cfg.train.batch_size,
        records=records,
        tokenizer_dir=tokenizer_dir,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    if train.skipped:
        print(f"skipped {len(train.skipped)} malformed rows; first: {train.skipped[0]}")

    def eval_pipeline():
        return make_pipeline(cfg.data, cfg.train.batch_size, records=records, tokenizer_dir=tokenizer_dir, split="eval")

    trainer = Trainer(
        cfg,
        model,
        next_token_loss,
        train,
        mesh=mesh,
        eval_data_fn=eval_pipeline if cfg.data.eval_fraction > 0 else None,
        tokenizer_dir=tokenizer_dir,
    )
    trainer.fit()
    print(f"done: run directory {run_dir} (config.yaml, checkpoints/, metrics.jsonl, tensorboard/, loss.png, hf/)")
    return 0


def _check_vocab(vocab_size: int, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    if n > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer in {tokenizer_dir} ({n} tokens)"
        )


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.pretrain"))
