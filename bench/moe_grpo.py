"""Tokens per second of the mixture-of-experts GRPO step with vLLM, with routing replay and without.

    .venv/bin/python bench/moe_grpo.py                    # 5 steps a mode, float32
    .venv/bin/python bench/moe_grpo.py --steps 3 --sampler-dtype bfloat16

The policy is bench/moe_step.py's random Qwen3-MoE (102.8M parameters, 25.8M active a token), started from its
Hugging Face directory, with an offline byte-level BPE tokenizer (reasoning-gym arithmetic problems, 512 tokens).
Each mode is `python -m recipes.grpo` on recipes/configs/grpo_tiny.yml with that model: the vLLM sampler on Ray
recording its routes (`rollout.record_routes=true`), 4 prompts x 4 samples of up to 64 tokens a step, a length
reward (variance in every group), one update a step. Reported per mode, over the steps after the first (its
compilations): the median of the run's own `tokens_per_s` (the trained batch's packed token slots, prompts and
completions, per second of the whole step less its compilation: generation, rewards, the update and the weight
sync; measured before 2026-11-29 as the completion tokens per step second), of the step's parts, the routing
mismatch and the log-prob gap between sampler and trainer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEYS = (
    "tokens_per_s",
    "time/step_s",
    "time/generate_s",
    "time/train_s",
    "time/sync_s",
    "moe/route_mismatch",
    "mismatch/logp_gap_mean",
)


def model_dir(work: Path) -> Path:
    """bench/moe_step.py's model, with an offline tokenizer beside it."""
    from bench.moe_step import build
    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    hf = build(work)
    texts = [r["text"] for r in reasoning_gym_records("basic_arithmetic", 300, seed=123)]
    tokenizer = build_tokenizer(texts, work / "tokenizer", vocab_size=512)
    for f in Path(tokenizer).iterdir():
        shutil.copy(f, hf / f.name)
    return hf


def run(hf: Path, run_dir: Path, mode: str, steps: int, sampler_dtype: str) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "recipes.grpo",
        "recipes/configs/grpo_tiny.yml",
        f"checkpoint.init_from={hf}",
        f"data.tokenizer_dir={hf}",
        f"run.run_dir={run_dir}",
        "reward.functions=[{fn: bench/bench_rewards.py:char_length}]",
        f"train.steps={steps}",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
        "rollout.max_tokens=64",
        "rollout.max_model_len=256",
        "rollout.kv_cache_gib=0.5",
        f"rollout.dtype={sampler_dtype}",
        "rollout.record_routes=true",
        f"rl.router_replay={mode}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode}: the run failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward/mean" in r][1:]  # the first step compiles
    return {k: statistics.median(r[k] for r in rows) for k in KEYS if all(k in r for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--sampler-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default="runs/bench_moe_grpo.json")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = model_dir(Path(tmp))
        for mode in ("replay", "off"):
            results[mode] = run(hf, Path(tmp) / mode, mode, args.steps, args.sampler_dtype)
            print(f"{mode:6s} " + "  ".join(f"{k} {v:.4g}" for k, v in results[mode].items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "sampler_dtype": args.sampler_dtype, **results}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
