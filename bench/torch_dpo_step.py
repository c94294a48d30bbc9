"""The peers' DPO step time, for bench/dpo_step.py (runs in the TRL venv): TRL's DPOTrainer, or a plain PyTorch loop.

    .venv-trl/bin/python bench/torch_dpo_step.py --mode trl   --model HF_DIR --data pairs.jsonl --out r.json
    .venv-trl/bin/python bench/torch_dpo_step.py --mode torch --model HF_DIR --data pairs.jsonl --out r.json

Both train the HF model on the same prompt / chosen / rejected rows Temper trains on (`batch` pairs a step), the
sigmoid DPO loss with beta 0.1, a frozen copy of the starting model as the live reference, float32, AdamW, on CPU.
TRL: `DPOTrainer` with `bf16=False` (its default bf16 runs ~17x slower on this CPU), timed per step with a
callback, with TRL's default gradient checkpointing (`trl`) or without it (`trl_no_ckpt`). torch: the floor,
eager: chosen and rejected each after its own copy of the prompt, padded to the
longest, one policy forward + backward and one reference forward (no grad) on the 2 x batch sequences, AdamW.
The first step (warm-up) is reported apart.
"""

from __future__ import annotations

import argparse
import copy
import json
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
    p.add_argument("--seq", type=int, default=256, help="the most tokens of prompt + one completion")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    times: list[float] = []
    if args.mode == "torch":
        ref = copy.deepcopy(model).eval()
        for q in ref.parameters():
            q.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()

        def logps(m, ids, attention, labels):
            logits = m(input_ids=ids, attention_mask=attention).logits[:, :-1]
            target = labels[:, 1:]
            mask = target != -100
            picked = torch.gather(logits.log_softmax(-1), 2, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            return (picked * mask).sum(-1)

        for step in range(args.steps + 1):
            start = time.perf_counter()
            batch = rows[step * args.batch : (step + 1) * args.batch]
            sides = [
                completion_row(tok, r["prompt"], r[side], args.seq) for side in ("chosen", "rejected") for r in batch
            ]
            ids, attention, target = padded([s for s, _ in sides], [lab for _, lab in sides], tok.pad_token_id)
            with torch.no_grad():
                ref_logp = logps(ref, ids, attention, target)
            logp = logps(model, ids, attention, target)
            n = len(batch)
            margin = (logp[:n] - ref_logp[:n]) - (logp[n:] - ref_logp[n:])
            loss = -F.logsigmoid(0.1 * margin).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    else:
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**trl_arguments(args, "trl_dpo"), beta=0.1, loss_type=["sigmoid"])
        trainer = DPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),
            args=config,
            train_dataset=Dataset.from_list(rows[: args.batch * (args.steps + 1)]),
            processing_class=tok,
            callbacks=[step_timer(times)],
        )
        trainer.train()
    write_result(args.out, times)


if __name__ == "__main__":
    main()
