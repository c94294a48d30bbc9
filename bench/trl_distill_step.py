"""TRL's on-policy DistillationTrainer step time (beta = 1: reverse KL on the student's own samples), for
bench/distill_step.py (runs in the TRL venv).

    .venv-trl/bin/python bench/trl_distill_step.py --student HF_DIR --teacher HF_DIR --prompts prompts.jsonl \
        --steps 5 --prompts-per-step 16 --max-tokens 16 --out result.json

Per step: `prompts_per_step` prompts, one completion each of at most `max_tokens` tokens sampled from the student
(transformers `generate`, TRL's default), the teacher's and the student's distributions on every completion token,
reverse KL, one optimizer update; float32 on CPU (bf16=False: TRL's bf16 default is ~17x slower on this CPU),
gradient checkpointing off (Temper keeps activations too). Every step timed with a callback.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--student", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from peer_common import online_arguments, step_timer  # this script's folder is on sys.path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    times: list[float] = []

    config = DistillationConfig(
        **online_arguments(args, "trl_distill_bench"),
        per_device_train_batch_size=args.prompts_per_step,
        max_completion_length=args.max_tokens,
        beta=1.0,
        fp16=False,
        gradient_checkpointing=False,
    )
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    tokenizer.padding_side = "left"
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_timer(times)],
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(args.out).write_text(json.dumps({"step_times": times, "losses": losses}))


if __name__ == "__main__":
    main()
