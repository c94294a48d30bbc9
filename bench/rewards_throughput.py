"""Reward throughput: completions/s of `math_verify` on 1,024 GSM8K-style completions, 1 and 2 workers.

    python bench/rewards_throughput.py [--n 1024] [--workers 1 2]

Problems come from reasoning-gym's `gsm_symbolic` (offline). Completions are a
seeded mix of what a policy writes early in training: boxed right and wrong
answers, <answer> tags, a trailing number, thousands separators, no answer.
Timing covers `RewardRunner.score` only (the pool is started and warm).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def completions(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    from core.sources import reasoning_gym_records

    rows = reasoning_gym_records("gsm_symbolic", min(n, 256), seed)
    rng = random.Random(seed)
    prompts, comps, golds = [], [], []
    for i in range(n):
        row = rows[i % len(rows)]
        gold = int(float(row["answer"]))
        guess = gold if rng.random() < 0.5 else gold + rng.choice([-10, -1, 1, 7])
        style = rng.randrange(5)
        work = "Let me work through it step by step. " * rng.randint(1, 8)
        text = [
            f"{work}So the answer is \\boxed{{{guess}}}.",
            f"<reasoning>{work}</reasoning><answer>{guess}</answer>",
            f"{work}The total is {guess:,} dollars.",
            f"{work}I am not sure.",
            f"{work}\\boxed{{\\frac{{{2 * guess}}}{{2}}}}",
        ][style]
        prompts.append(row["question"])
        comps.append(text)
        golds.append(row["answer"])
    return prompts, comps, golds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "rewards_throughput.json"))
    args = p.parse_args()

    from rewards.config import RewardConfig
    from rewards.runner import RewardRunner

    prompts, comps, golds = completions(args.n)
    result = {"n": args.n}
    for workers in args.workers:
        cfg = RewardConfig(functions=[{"fn": "math_verify"}], math_verify_num_procs=workers, math_verify_timeout=600)
        with RewardRunner(cfg) as runner:
            runner.score(prompts[:8], comps[:8], {"answer": golds[:8]})  # warm: imports in every worker
            start = time.perf_counter()
            batch = runner.score(prompts, comps, {"answer": golds})
            seconds = time.perf_counter() - start
        rate = args.n / seconds
        print(
            f"{workers} worker(s): {seconds:.2f} s, {rate:,.0f} completions/s, "
            f"accuracy {batch.values['math_verify'].mean():.3f}, failures {int(batch.failed['math_verify'].sum())}"
        )
        result[f"workers_{workers}"] = {"seconds": seconds, "completions_per_s": rate}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
