"""The peers' SFT step time, for bench/sft_step.py (runs in the TRL venv): TRL's SFTTrainer, or a plain PyTorch loop.

    .venv-trl/bin/python bench/torch_sft_step.py --mode trl   --model HF_DIR --data rows.jsonl --out r.json
    .venv-trl/bin/python bench/torch_sft_step.py --mode torch --model HF_DIR --data rows.jsonl --out r.json

Both train the HF model on the same prompt / completion rows Temper trains on (`batch` rows a step, loss on
the completion tokens only, no packing), float32, AdamW, on CPU. TRL: `SFTTrainer` with
`completion_only_loss=True, bf16=False` (its default bf16 runs ~17x slower on this CPU), timed per step with a
callback. torch: the floor, eager — tokenize, pad to the longest row, labels -100 on prompt and padding,
forward, cross-entropy, backward, AdamW step. The first step (warm-up) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peer_timing import step_timer, write_result  # bench/, the script's own directory


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["trl", "torch"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    times: list[float] = []
    if args.mode == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()
        for step in range(args.steps + 1):
            start = time.perf_counter()
            batch = rows[step * args.batch : (step + 1) * args.batch]
            seqs, labels = [], []
            for r in batch:
                prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
                completion = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = (prompt + completion)[: args.seq]
                seqs.append(ids)
                labels.append(([-100] * len(prompt) + completion)[: args.seq])
            width = max(map(len, seqs))
            input_ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
            loss = model(input_ids=input_ids, attention_mask=attention, labels=target).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(
            output_dir=str(Path(args.out).parent / "trl_sft"),
            per_device_train_batch_size=args.batch,
            max_steps=args.steps + 1,
            learning_rate=1e-4,
            max_length=args.seq,
            completion_only_loss=True,
            packing=False,
            bf16=False,
            fp16=False,
            use_cpu=True,
            logging_steps=1000,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
        )
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(rows[: args.batch * (args.steps + 1)]),
            processing_class=tok,
            callbacks=[step_timer(times)],
        )
        trainer.train()
    write_result(args.out, times)


if __name__ == "__main__":
    main()
