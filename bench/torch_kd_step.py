"""The plain PyTorch loop of offline top-k distillation, for bench/distill_step.py (runs in the TRL venv, which
has torch): an HF student, AdamW, eager float32, and the loss Temper's offline regime trains (forward KL between
the teacher's stored top-k and the student's log-probs at those ids, both renormalised over the k).

    .venv-trl/bin/python bench/torch_kd_step.py --student HF_DIR --batches batches.npz --serve

`--serve`: wait on stdin for a JSON list holding one batch index, run that step, answer {"seconds": ...}
(`bench/interleaved.py`), so that the two sides' steps alternate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--student", required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--serve", action="store_true")
    args = p.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    data = np.load(args.batches)
    model = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def step(i: int) -> float:
        tokens = torch.from_numpy(data["tokens"][i]).long()  # [B, L]
        attention = torch.from_numpy(data["attention"][i]).long()
        target = torch.from_numpy(data["target"][i]).bool()  # [B, L]: token l is a target (predicted at l - 1)
        ids = torch.from_numpy(data["topk_ids"][i]).long()  # [B, L, k] at the target's position
        logp = torch.from_numpy(data["topk_logp"][i]).float()
        start = time.perf_counter()
        logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1]  # predicts tokens 1..L-1
        mask = target[:, 1:]
        logq = torch.log_softmax(logits[mask], dim=-1)  # [N, V]
        logq_k = torch.gather(logq, 1, ids[:, 1:][mask])
        logq_k = logq_k - torch.logsumexp(logq_k, dim=-1, keepdim=True)
        logp_k = logp[:, 1:][mask]
        logp_k = logp_k - torch.logsumexp(logp_k, dim=-1, keepdim=True)
        loss = (logp_k.exp() * (logp_k - logq_k)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    if args.serve:
        for line in sys.stdin:
            (i,) = json.loads(line)
            print(json.dumps({"seconds": step(int(i))}), flush=True)


if __name__ == "__main__":
    main()
