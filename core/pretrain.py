"""Pretraining: the next-token loss over documents, the core engine's own method (`core.method.Method`).

    run = build_run(cfg, PRETRAINING)      # python -m recipes.pretrain CONFIG.yml
    run.fit()

Rows are text (`data.format=text`, the `text` field; `data.columns={text: ...}` names another column), each a
document: the tokenizer's BOS (if it adds one), the text, EOS. Every token after the first is a target; the loss
is `core.losses.nll_loss`, the mean over the targets of the whole global batch, so packing (`data.packing`,
documents in their own segments) and micro-batching leave the gradient unchanged. `next_token_parts` is what SFT
shares with it: the pipelines of a row format and the held-out loss and perplexity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from core.batch import PackedBatch, pad_rows
from core.batch_source import Evaluation
from core.config import Config
from core.data import DataBatch, Examples, RowFormat, TextRows, make_pipeline, to_data_batch, tokenize_examples
from core.loop import Hook
from core.losses import nll_loss, perplexity
from core.method import Method
from core.run import MethodParts, RunContext, check_rows
from core.train import LossFn


def next_token_parts(
    run: RunContext,
    rows: RowFormat,
    hooks: Callable[[Examples], Sequence[Hook]] | None = None,
    examples: Examples | None = None,
) -> MethodParts:
    """The training pipeline of `rows`, and, with `data.eval_fraction`, the held-out loss and perplexity (the last
    eval batch padded to `train.batch_size` rows, so that it runs the compiled shape); `hooks(examples)`: the
    method's own, given the tokenized rows and their split. `examples`: the rows already tokenized (by a method
    that checks them against something of its own first)."""
    cfg = run.cfg

    def pipeline(split: str):
        return make_pipeline(
            tokenized,
            cfg.data,
            cfg.train.batch_size,
            split=split,
            micro_batches=cfg.train.micro_batches if split == "train" else 1,
            row_multiple=run.row_multiple,
        )

    tokenized = examples if examples is not None else tokenize_examples(run.records, rows, run.tokenizer, cfg.data)
    evaluation = None
    if tokenized.eval:

        def batches() -> Iterable[DataBatch]:
            for d in pipeline("eval"):
                yield DataBatch(pad_rows(d.batch, cfg.train.batch_size), d.example_ids)

        evaluation = Evaluation(batches, derive=perplexity)
    own = hooks(tokenized) if hooks is not None else ()
    return MethodParts(pipeline("train"), evaluation, hooks=own, skipped=tokenized.skipped)


def full_rows_batch(cfg: Config, prompt_tokens: int = 0, seed: int = 0) -> PackedBatch:
    """`train.batch_size` rows of `data.seq_len` random tokens, one document a row, the first `prompt_tokens` of each
    without loss, as the data pipeline packs them (`core.data.to_data_batch`)."""
    b, t = cfg.train.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(seed)
    rows = {
        "tokens": rng.integers(1, cfg.model.vocab_size, (b, t)).astype(np.int32),
        "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
        "segment_ids": np.ones((b, t), np.int32),
        "loss_mask": np.ones((b, t), np.int32),
        "example_ids": np.repeat(np.arange(b, dtype=np.int32)[:, None], t, axis=1),
    }
    rows["loss_mask"][:, :prompt_tokens] = 0
    return to_data_batch(rows, cfg.train.micro_batches).batch


class Pretraining(Method):
    name = "pretraining"

    def check(self, cfg: Config) -> None:
        check_rows(
            cfg, "pretraining", {"text": "a `text` field"}, "; prompt / completion and chat rows are SFT (recipes.sft)"
        )

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]:
        return (r["text"] for r in records if isinstance(r.get("text"), str))

    def loss(self, cfg: Config) -> LossFn:
        return nll_loss

    def parts(self, run: RunContext) -> MethodParts:
        return next_token_parts(run, TextRows())

    def example_batch(self, cfg: Config, row_multiple: int) -> PackedBatch:
        return full_rows_batch(cfg)  # every row full: train.batch_size rows, a multiple of the data shards


PRETRAINING = Pretraining()
