"""DPO step time: Temper vs TRL's DPOTrainer vs a plain PyTorch loop, on the same model, pairs and batch, one run.

    python bench/dpo_step.py                        # tiny and 100M             (make bench-dpo)
    python bench/dpo_step.py --sizes tiny           # tiny only: 16 timed steps (--steps N to change)

Every side trains the same HF model (random init, float32) on the same pairs: reasoning-gym text cut to a
16-128 token prompt and two 16-127 token completions, `batch` pairs a step, the sigmoid loss with beta 0.1,
AdamW, and the starting model, frozen, as a live reference (one reference pass a step on every side). Temper's
step is the reference pass (`posttrain.frozen.FrozenModel`) plus `core.learner.Learner.update` on the
`posttrain.dpo.pairs` batch: each pair one row, its prompt once and the two completions as branches (the same
pairs per step as the peers), and again packed (several pairs a row). It is also timed with the reference
log-probs precomputed (`dpo.precompute_ref_logps`: the update alone). Each new batch shape is compiled and run
once before it is timed, as a run does once per shape (as bench/sft_step.py does). TRL's DPOTrainer
(`bf16=False`; with TRL's default gradient checkpointing, and without it: `trl_no_ckpt`) and the plain loop put
each completion after its own copy of the prompt; they run in the TRL environment (`.venv-trl`, created on first
use). Step times exclude the first step; tokens/s counts real (non-padding) tokens of the peers' layout, the work
all sides do.

Memory: the shared-prompt layout holds prompt + chosen + rejected tokens where the peers hold
2 x prompt + chosen + rejected (activations scale with tokens); precomputed reference log-probs keep the
reference's parameters out of memory. Goal (issue 17): Temper <= 0.5x TRL's step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo_step import trl_python  # noqa: E402
from bench.sft_step import (  # noqa: E402
    SIZES,
    compile_and_warm,
    hf_learner,
    hf_model,
    peers_first,
    steps_for,
    text_pieces,
    with_steps,
    write_results,
)


def build(size: str, work: Path, tokenizer: str, pairs: int, seq: int) -> tuple[Path, Path, int]:
    """An HF model directory for `size` (with the tokenizer), the pairs file, and the parameter count."""
    import numpy as np

    hf, params = hf_model(size, work, tokenizer, seq)
    data = work / "pairs.jsonl"
    if not data.exists():
        rng = np.random.default_rng(0)
        lengths = [
            [int(rng.integers(16, 129)), int(rng.integers(16, 128)), int(rng.integers(16, 128))] for _ in range(pairs)
        ]
        out = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in text_pieces(tokenizer, lengths)]
        data.write_text("".join(json.dumps(r) + "\n" for r in out))
    return hf, data, params


def temper(hf: Path, data: Path, tokenizer: str, args, mode: str) -> dict:
    """mode: `rows` (a pair a row), `packed`, or `precomputed` (a pair a row, no reference pass)."""
    import numpy as np
    from transformers import AutoTokenizer

    from posttrain.config import DPOConfig
    from posttrain.dpo.data import PairLayout, pair_batch
    from posttrain.dpo.objective import preference_objective, with_reference
    from posttrain.dpo.pairs import tokenize_pairs
    from posttrain.frozen import FrozenModel

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    pairs, _, _ = tokenize_pairs(
        rows, AutoTokenizer.from_pretrained(tokenizer), data_format="prompt_completion", seq_len=2 * args.seq
    )
    layout = PairLayout(2 * args.seq, pack=mode == "packed")
    learner = hf_learner(hf, preference_objective(DPOConfig(beta=0.1)), total_updates=args.steps + 1)
    reference = FrozenModel.copy_of(learner.model(), learner.mesh, "reference")
    per_step = 4 * args.batch if mode == "packed" else args.batch  # packed: more pairs in fewer, fuller rows
    times, tokens, pair_counts, rows_used = [], [], [], []
    for step in range(args.steps + 1):
        chunk = pairs[step * per_step : (step + 1) * per_step]
        item = pair_batch(chunk, slots=per_step, micro_batches=1, layout=layout)
        batch = with_reference(item.batch, reference)  # compiles and runs the reference pass once
        compile_and_warm(learner, batch)  # not step time
        start = time.perf_counter()
        if mode != "precomputed":
            batch = with_reference(item.batch, reference)
        learner.update(batch)
        times.append(time.perf_counter() - start)
        tokens.append(sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in chunk))
        pair_counts.append(len(chunk))
        rows_used.append(int((np.asarray(batch.packed.segment_ids) > 0).sum()))
    steady = times[1:]
    return {
        "first_step_s": times[0],
        "median_step_s": statistics.median(steady),
        "mean_step_s": statistics.mean(steady),
        "tokens_per_s": sum(tokens[1:]) / sum(steady),  # in the peers' layout: comparable work
        "pairs_per_step": statistics.mean(pair_counts[1:]),
        "held_tokens_per_pair": sum(rows_used[1:]) / sum(pair_counts[1:]),
        "peer_tokens_per_pair": sum(tokens[1:]) / sum(pair_counts[1:]),
        "compile_memory": learner.last_compile,
    }


def peer(mode: str, hf: Path, data: Path, args, work: Path) -> dict:
    out = work / f"{mode}_{hf.name}.json"
    cmd = [str(trl_python()), str(ROOT / "bench" / "torch_dpo_step.py"), "--mode", mode, "--model", str(hf)]
    cmd += ["--data", str(data), "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
    subprocess.run([*cmd, "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


SIDES = ["temper", "temper_packed", "temper_precomputed", "trl", "trl_no_ckpt", "torch"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "100M"], choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=None, help="timed steps a side (default: 16 at tiny, else 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="the most tokens of prompt + one completion")
    p.add_argument("--out", default="runs/bench_dpo.json")
    p.add_argument(
        "--sides", nargs="+", default=SIDES, choices=SIDES, help="the ratios need temper, trl, trl_no_ckpt and torch"
    )
    args = p.parse_args()

    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = str(
            build_tokenizer((r["text"] for r in reasoning_gym_records("basic_arithmetic", 2000, 0)), work / "tok")
        )
        most_steps = max(steps_for(size, args.steps) for size in args.sizes)  # one pairs file serves every size
        for size in args.sizes:
            hf, data, params = build(size, work, tokenizer, 4 * args.batch * (most_steps + 2), args.seq)
            args_at = with_steps(args, size)
            print(f"== {size}: {params / 1e6:.1f}M parameters, {args.batch} pairs a step", flush=True)
            row: dict = {"params": params, "reference_bytes": 4 * params}
            for name in peers_first(args.sides):
                if name.startswith("temper"):
                    mode = {"temper": "rows", "temper_packed": "packed", "temper_precomputed": "precomputed"}[name]
                    row[name] = temper(hf, data, tokenizer, args_at, mode)
                else:
                    row[name] = peer(name, hf, data, args_at, work)
                print(f"   {name:19s} {row[name]['median_step_s']:.3f} s/step", flush=True)
            results[size] = row
            if not {"temper", "trl", "trl_no_ckpt", "torch"} <= set(row):
                continue
            for name in ("trl", "trl_no_ckpt", "torch"):
                row[name]["tokens_per_s"] = row["temper"]["tokens_per_s"] * (
                    row["temper"]["median_step_s"] / row[name]["median_step_s"]
                )  # the same pairs per step: the same tokens
            t = row["temper"]
            row["ratio_vs_trl"] = t["median_step_s"] / row["trl"]["median_step_s"]
            row["ratio_vs_trl_no_ckpt"] = t["median_step_s"] / row["trl_no_ckpt"]["median_step_s"]
            row["ratio_vs_torch"] = t["median_step_s"] / row["torch"]["median_step_s"]
            row["shared_prompt_token_share"] = t["held_tokens_per_pair"] / t["peer_tokens_per_pair"]
            print(
                f"   Temper / TRL {row['ratio_vs_trl']:.2f}x (no checkpointing {row['ratio_vs_trl_no_ckpt']:.2f}x), "
                f"Temper / torch {row['ratio_vs_torch']:.2f}x; tokens/s: "
                + ", ".join(f"{k} {row[k]['tokens_per_s']:,.0f}" for k in SIDES if k in row)
                + f"; shared prompt holds {row['shared_prompt_token_share']:.0%} of the peers' tokens; "
                f"precomputing frees {row['reference_bytes'] / 2**20:.0f} MiB of reference parameters",
                flush=True,
            )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
