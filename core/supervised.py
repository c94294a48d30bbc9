"""Next-token training on a dataset, the part pretraining and SFT share: model, tokenizer, pipelines, loop.

    summary = run_supervised(cfg)                          # recipes.pretrain
    summary = run_supervised(cfg, hooks=sft_hooks)         # posttrain.sft: + greedy generations at each eval

The model starts from `checkpoint.init_from` (an HF directory or a Temper run;
its shape wins over `model.*`) or from a random init. The tokenizer is
`data.tokenizer_dir`, or one trained on the text into `run_dir/tokenizer`.
The loss is `core.losses.nll_loss` over the pipeline's targets (every token
of text; the completion or the assistant turns with
`sft.completion_only_loss`), normalised over the targets of the whole global
batch. `data.eval_fraction` > 0 holds rows out for `train.eval_every`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax

from core.config import Config
from core.config_loader import ConfigError
from core.loop import Hook, Trainer


@dataclass
class SupervisedRun:
    cfg: Config  # with the model section the initial checkpoint decided
    trainer: Trainer
    tokenizer_dir: str
    eval_records: list[dict]  # the held-out rows (for evaluations that generate)


def build_supervised(cfg: Config, hooks: Callable[[SupervisedRun], Sequence[Hook]] | None = None) -> SupervisedRun:
    """Everything `run_supervised` trains with, ready to `fit`."""
    from core.checkpoint import initial_model
    from core.config import resolve_mesh_shape
    from core.data import load_records, make_pipeline
    from core.learner import Learner
    from core.losses import nll_loss
    from core.mesh import make_mesh
    from core.metrics import device_memory
    from core.models.summary import parameter_summary
    from core.tokenizer import tokenizer_for_run
    from core.train import batch_shards

    try:  # fail early, with the sizes, on a bad mesh
        resolve_mesh_shape(cfg.mesh, jax.device_count())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mesh = make_mesh(cfg.mesh)
    run_dir = Path(cfg.run.run_dir)
    records = load_records(cfg.data.source, cfg.data) if cfg.data.source is not None else []
    texts = (r[cfg.data.text_field] for r in records if isinstance(r.get(cfg.data.text_field), str))
    tokenizer_dir = tokenizer_for_run(cfg.data.tokenizer_dir, texts, run_dir, cfg.model.vocab_size)
    model, cfg = initial_model(cfg, mesh)
    if cfg.checkpoint.init_from is not None:
        print(f"initialised from {cfg.checkpoint.init_from}")
    check_vocab(cfg.model.vocab_size, tokenizer_dir)
    if cfg.mesh.debug_sharding:
        print(parameter_summary(model))
    print(device_memory() + " (after model init)")
    completion_only = cfg.sft.completion_only_loss

    def pipeline(split: str):
        return make_pipeline(
            cfg.data,
            cfg.train.batch_size,
            records=records,
            tokenizer_dir=tokenizer_dir,
            split=split,
            completion_only=completion_only,
            micro_batches=cfg.train.micro_batches,
            row_multiple=batch_shards(mesh),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    train = pipeline("train")
    if train.skipped:
        print(f"skipped {len(train.skipped)} malformed rows; first: {train.skipped[0]}")
    learner = Learner(model, mesh, nll_loss, cfg.optim, total_updates=cfg.train.steps, seed=cfg.run.seed)
    held_out = cfg.data.eval_fraction > 0
    n_eval = round(cfg.data.eval_fraction * len(records))
    trainer = Trainer(
        cfg, learner, train, eval_data_fn=(lambda: pipeline("eval")) if held_out else None, tokenizer_dir=tokenizer_dir
    )
    held = [records[i] for i in range(len(records) - n_eval, len(records))] if held_out else []  # a Dataset too
    run = SupervisedRun(cfg, trainer, tokenizer_dir, held)
    if hooks is not None:
        trainer.hooks.extend(hooks(run))
    return run


def run_supervised(cfg: Config, hooks: Callable[[SupervisedRun], Sequence[Hook]] | None = None) -> SupervisedRun:
    """Train to `train.steps` (resuming from `run.run_dir`); returns the finished run."""
    run = build_supervised(cfg, hooks)
    run.trainer.fit()
    return run


def check_vocab(vocab_size: int, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    if n > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer in {tokenizer_dir} ({n} tokens)"
        )
