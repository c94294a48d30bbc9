"""Run a teacher once over a dataset and write its top-k at every target (`posttrain.distill.topk_store`).

    python -m recipes.distill_logits CONFIG.yml distill.teacher=runs/quickstart/hf distill.logits_dir=runs/kd/topk

The rows are SFT's (`data.format` chat or prompt_completion, `posttrain.sft.row_format`), tokenized with the
student's tokenizer (`data.tokenizer_dir`, else the teacher's) exactly as the training run will tokenize them.
Each shard's rows go through the teacher `distill.dump_batch_rows` at a time, one row each (padded to
`data.seq_len`); at every target the teacher's final hidden state, divided by `distill.dump_temperature`, goes
through `core.kernels.divergence.chunked_topk` (the vocabulary in chunks, never [tokens, vocab] at once) and the
`distill.dump_k` ids and log-probs are written in `distill.dump_dtype`. A killed dump resumes at its first
unwritten shard; shards of other data are an error naming them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from core.config_loader import ConfigError
from core.data import Examples, to_data_batch
from core.kernels.divergence import chunked_topk
from core.targets import target_states
from core.train import place_batch, split_micro_batches
from posttrain.config import PostTrainConfig
from posttrain.distill.topk_store import FORMAT, DumpHeader, DumpPlan, start_dump, tokenizer_digest, write_shard


def data_settings(cfg: PostTrainConfig, tokenizer) -> dict:
    """What ties a dump to the rows of a run under `cfg` (`topk_store.DATA_KEYS`)."""
    return dict(
        format=FORMAT,
        tokenizer=tokenizer_digest(tokenizer),
        seq_len=cfg.data.seq_len,
        truncation_side=cfg.data.truncation_side,
        source=str(cfg.data.source),
        data_format=cfg.data.format,
    )


def dump_header(cfg: PostTrainConfig, tokenizer, vocab_size: int, teacher: str = "") -> DumpHeader:
    """What a dump made under `cfg` records."""
    d = cfg.distill
    return DumpHeader(
        k=d.dump_k,
        dtype=d.dump_dtype,
        temperature=d.dump_temperature,
        teacher=teacher,
        vocab_size=vocab_size,
        rows_per_shard=d.dump_rows_per_shard,
        **data_settings(cfg, tokenizer),
    )


@dataclass
class DumpSummary:
    shards_written: int
    shards_total: int
    targets: int
    seconds: float


def topk_pass(graphdef: nnx.GraphDef, k: int, temperature: float, vocab: int):
    """A jitted `(teacher params, packed batch) -> ([B, C, k] ids, [B, C, k] log-probs)` at every target slot."""

    def run(params, packed):
        model = nnx.merge(graphdef, params)
        states = target_states(model, packed)
        ids, logp = chunked_topk(
            states.hidden / temperature, states.weight, k, model.cfg.vocab_chunk_size, states.layout, vocab
        )
        return states.to_slots(ids), states.to_slots(logp)

    return jax.jit(run)


def dump_topk(
    cfg: PostTrainConfig, examples: Examples, teacher, mesh, tokenizer, vocab: int, progress=print
) -> DumpSummary:
    """Write (or finish) the dump of `examples` in `cfg.distill.logits_dir` with `teacher` (an nnx model)."""
    d = cfg.distill
    if d.logits_dir is None:
        raise ConfigError("the dump needs distill.logits_dir (the directory to write the teacher's top-k into)")
    header = dump_header(cfg, tokenizer, vocab, teacher=str(d.teacher))
    plan = DumpPlan.of(header, examples)
    todo = start_dump(d.logits_dir, plan, examples)
    graphdef, params = nnx.split(teacher)
    run = topk_pass(graphdef, d.dump_k, d.dump_temperature, vocab)
    start, targets = time.perf_counter(), 0
    if len(todo) < len(plan.shards):
        progress(f"resuming the dump: {len(plan.shards) - len(todo)} of {len(plan.shards)} shards already written")
    for i in todo:
        ids, logp, counts = [], [], []
        rows = plan.shards[i]
        for b in range(0, len(rows), d.dump_batch_rows):
            part = rows[b : b + d.dump_batch_rows]
            got_ids, got_logp, got_counts = _score(run, params, mesh, examples, part, d.dump_batch_rows, cfg)
            ids += got_ids
            logp += got_logp
            counts += got_counts
        write_shard(d.logits_dir, plan, i, examples, np.concatenate(ids), np.concatenate(logp), counts)
        targets += sum(counts)
        elapsed = time.perf_counter() - start
        progress(
            f"dump: shard {i + 1}/{len(plan.shards)} ({len(rows)} rows, {sum(counts)} targets) | "
            f"{targets / max(elapsed, 1e-9):.0f} targets/s"
        )
    return DumpSummary(len(todo), len(plan.shards), targets, time.perf_counter() - start)


def _score(run, params, mesh, examples: Examples, rows: list[int], batch_rows: int, cfg: PostTrainConfig):
    """The top-k of every target of `rows` (one row each, padded to `batch_rows` rows of `data.seq_len`)."""
    length = cfg.data.seq_len
    arrays = {
        name: np.zeros((batch_rows, length), np.int32)
        for name in ("tokens", "positions", "segment_ids", "loss_mask", "example_ids")
    }
    arrays["example_ids"][:] = -1
    for r, row in enumerate(rows):
        ex = examples.by_row[row]
        n = len(ex.tokens)
        arrays["tokens"][r, :n] = ex.tokens
        arrays["positions"][r, :n] = np.arange(n)
        arrays["segment_ids"][r, :n] = 1
        arrays["loss_mask"][r, :n] = ex.targets
        arrays["example_ids"][r, :n] = row
    packed = to_data_batch(arrays, 1).batch
    placed = place_batch(split_micro_batches(packed, 1, mesh), mesh)
    with jax.set_mesh(mesh):
        ids, logp = jax.device_get(run(params, jax.tree.map(lambda x: x[0], placed)))
    ids, logp = np.asarray(ids), np.asarray(logp)
    mask = np.asarray(packed.target_mask) > 0
    out_ids, out_logp, counts = [], [], []
    for r, row in enumerate(rows):
        n = int(mask[r].sum())
        expected = int((np.asarray(examples.by_row[row].targets) > 0).sum())
        if n != expected:
            raise AssertionError(f"row {row}: {n} targets scored, its example has {expected}")
        out_ids.append(ids[r, :n])
        out_logp.append(logp[r, :n])
        counts.append(n)
    return out_ids, out_logp, counts
