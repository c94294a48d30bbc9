"""The peers' SFT step time, for bench/sft_step.py (runs in the TRL venv): TRL's SFTTrainer, or a plain PyTorch loop.

    .venv-trl/bin/python bench/torch_sft_step.py --mode trl   --model HF_DIR --data rows.jsonl --out r.json
    .venv-trl/bin/python bench/torch_sft_step.py --mode torch --model HF_DIR --data rows.jsonl --out r.json
    .venv-trl/bin/python bench/torch_sft_step.py --mode torch --model HF_DIR --data rows.jsonl --serve

Both train the HF model on the same prompt / completion rows Temper trains on (`batch` rows a step, loss on
the completion tokens only, no packing), float32, AdamW, on CPU. TRL: `SFTTrainer` with
`completion_only_loss=True, bf16=False` (its default bf16 runs ~17x slower on this CPU), timed per step with a
callback, with TRL's default gradient checkpointing (`trl`) or without it (`trl_no_ckpt`). torch: the floor,
eager — tokenize, pad to the longest row, labels -100 on prompt and padding,
forward, cross-entropy, backward, AdamW step. The first step (warm-up) is reported apart.

`--serve` (torch only) steps on request, for bench/interleaved.py: each stdin line is a JSON list of row indices
into `--data`, answered by one stdout line `{"seconds": ...}` once that step is done.

`--lora R` (bench/lora_step.py) trains LoRA adapters of rank R (alpha 2R, no dropout) on the seven projections
instead of the whole model, with PEFT: TRL's SFTTrainer takes it as `peft_config`, the plain loop wraps the model
with `peft.get_peft_model` and gives AdamW the adapters alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# bench/, the script's own directory
from peer_common import completion_row, padded, step_timer, trl_arguments, write_result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["trl", "trl_no_ckpt", "torch"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out")
    p.add_argument("--serve", action="store_true", help="torch only: step on the rows each stdin line names")
    p.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank (PEFT) instead")
    args = p.parse_args()
    if args.serve != (args.out is None) or (args.serve and args.mode != "torch"):
        p.error("give --out, or --serve with --mode torch")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_config = LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
        )
    times: list[float] = []
    if args.mode == "torch":
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
        model.train()

        def step(batch: list[dict]) -> float:
            start = time.perf_counter()
            seqs, labels = zip(*(completion_row(tok, r["prompt"], r["completion"], args.seq) for r in batch))
            input_ids, attention, target = padded(list(seqs), list(labels), tok.pad_token_id)
            loss = model(input_ids=input_ids, attention_mask=attention, labels=target).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        if args.serve:
            for line in sys.stdin:
                print(json.dumps({"seconds": step([rows[i] for i in json.loads(line)])}), flush=True)
            return
        for i in range(args.steps + 1):
            times.append(step(rows[i * args.batch : (i + 1) * args.batch]))
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**trl_arguments(args, "trl_sft"), completion_only_loss=True, packing=False)
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(rows[: args.batch * (args.steps + 1)]),
            processing_class=tok,
            callbacks=[step_timer(times)],
            peft_config=peft_config,
        )
        trainer.train()
    write_result(args.out, times)


if __name__ == "__main__":
    main()
