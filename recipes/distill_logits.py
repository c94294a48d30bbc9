"""Run a teacher once over a dataset and write its top-k next-token distribution at every target, for offline
distillation (`python -m recipes.distill` with distill.regime=offline reads it).

    python -m recipes.distill_logits CONFIG.yml distill.teacher=runs/teacher/hf distill.logits_dir=runs/kd/topk
    python -m recipes.distill_logits recipes/configs/distill_tiny.yml distill.dump_k=64 distill.dump_dtype=bfloat16

The rows are the training run's (`data.*`, SFT's formats), tokenized with its tokenizer (`data.tokenizer_dir`,
else the teacher's); shards and index format in docs/distillation.md. A killed dump resumes where it stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path

from core.cli import run_recipe
from core.compile_only import refuse
from core.config_loader import ConfigError, config_from_argv

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "distill_tiny.yml"


def main(argv: list[str]) -> int:
    from core.data import load_tokenizer, tokenize_examples
    from core.mesh import make_mesh
    from core.sources import load_records
    from core.tokenizer import tokenizer_for_run
    from posttrain.config import PostTrainConfig
    from posttrain.distill.dump import dump_topk
    from posttrain.distill.method import check_top_k
    from posttrain.distill.teacher import load_teacher, teacher_tokenizer_matches
    from posttrain.sft import SFT, row_format

    cfg = config_from_argv(argv, DEFAULT_CONFIG, schema=PostTrainConfig)
    refuse(cfg, "the teacher's dump (it trains nothing)", "leave train.compile_only unset")
    d = cfg.distill
    if d.teacher is None or d.logits_dir is None:
        raise ConfigError("the dump needs distill.teacher (the model to run) and distill.logits_dir (where to write)")
    mesh = make_mesh(cfg.mesh)
    records = load_records(cfg.data)
    tokenizer_dir = tokenizer_for_run(
        cfg.data.tokenizer_dir, SFT.tokenizer_texts(records), cfg.run.run_dir, cfg.model.vocab_size, d.teacher
    )
    tokenizer = load_tokenizer(tokenizer_dir)
    check_top_k(d.dump_k, "distill.dump_k", tokenizer)  # before the teacher loads
    teacher = load_teacher(cfg, mesh, len(tokenizer), f"the tokenizer {tokenizer_dir}")
    mismatch = teacher_tokenizer_matches(d.teacher, tokenizer, tokenizer_dir)
    if mismatch:
        raise ConfigError(mismatch)
    examples = tokenize_examples(
        records, row_format(cfg.data.format, cfg.sft.completion_only_loss), tokenizer, cfg.data
    )
    if examples.skipped:
        print(f"skipped {len(examples.skipped)} malformed rows; first: {examples.skipped[0]}")
    print(
        f"teacher {d.teacher}: top-{d.dump_k} at T={d.dump_temperature} of {len(examples.by_row)} rows "
        f"-> {d.logits_dir}"
    )
    summary = dump_topk(cfg, examples, teacher, mesh, tokenizer, vocab=min(teacher.cfg.vocab_size, len(tokenizer)))
    print(
        f"done: {summary.shards_written} of {summary.shards_total} shards written ({summary.targets} targets, "
        f"{summary.seconds:.1f} s) in {d.logits_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.distill_logits", supervise=True))
