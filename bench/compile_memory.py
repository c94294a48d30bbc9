"""Per-device memory of each method's real update for a full-size preset over a 64-device mesh, compile-only.

    .venv/bin/python bench/compile_memory.py [--preset llama3.1-8b] [--fsdp 16] [--tensor 4] [--micro-batches 4]
    .venv/bin/python bench/compile_memory.py --fsdp 8 --tensor 1 --methods sft --lora 16   # LoRA r16 and full SFT

Runs `python -m recipes.<method> ... train.compile_only=true` for pretraining, SFT, DPO and GRPO in one process
each, on as many fake CPU devices as the mesh has (`core.compile_only`: the method's loss in the Learner's jitted
step, on a batch its own builder made; parameters and optimizer state abstract), and prints XLA's memory analysis
per device as a Markdown table. XLA:CPU plans the buffers, so `temp` is the CPU compiler's plan, not a TPU's or a
GPU's; the arguments (parameters and AdamW moments, sharded) are what any backend holds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"arguments ([\d.]+) GiB, outputs ([\d.]+) GiB, temp ([\d.]+) GiB, .* total ([\d.]+) GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.1-8b")
    p.add_argument("--fsdp", type=int, default=16)
    p.add_argument("--tensor", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64, help="sequences (DPO: pairs)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--remat", default="full")
    p.add_argument("--scan-unroll", default=None, help="model.scan_unroll (default: the preset's; true: unrolled)")
    p.add_argument("--methods", nargs="+", default=["pretrain", "sft", "dpo", "grpo"])
    p.add_argument("--lora", type=int, default=0, help="also each method with LoRA adapters of this rank (alpha 2R)")
    args = p.parse_args()
    base = (ROOT / "core" / "configs" / "base.yml").read_text()
    common = [
        "train.compile_only=true",
        f"model.preset={args.preset}",
        f"model.remat_policy={args.remat}",
        f"mesh.fsdp={args.fsdp}",
        f"mesh.tensor={args.tensor}",
        f"data.seq_len={args.seq_len}",
        f"train.batch_size={args.batch_size}",
        f"train.micro_batches={args.micro_batches}",
        *([f"model.scan_unroll={args.scan_unroll}"] if args.scan_unroll is not None else []),
    ]
    # GRPO: 8 prompts x 8 completions of half the model length each, rows of the model length.
    grpo = [
        f"rollout.max_model_len={args.seq_len}",
        f"rollout.max_tokens={args.seq_len // 2}",
        f"rl.batch.prompts_per_step={args.batch_size // 8}",
        "rl.batch.num_generations=8",
    ]
    every = {"pretrain": [], "sft": [], "dpo": [], "grpo": grpo}
    methods = {m: every[m] for m in args.methods}
    if args.lora:  # the same updates of LoRA adapters on every projection (pretraining has no LoRA run: it is SFT's)
        lora = [f"model.lora.rank={args.lora}", f"model.lora.alpha={2 * args.lora}"]
        methods.update({f"{m}+lora{args.lora}": [*every[m], *lora] for m in args.methods if m != "pretrain"})
    devices = args.fsdp * args.tensor
    unroll = args.scan_unroll or "the preset's"
    print(
        f"{args.preset}, mesh fsdp {args.fsdp} x tensor {args.tensor} = {devices} devices, remat {args.remat}, "
        f"scan_unroll {unroll}"
    )
    print("| method | packed rows x tokens | arguments | outputs | temp | total (GiB per device) | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "base.yml"
        cfg.write_text(base)
        env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        for method, extra in methods.items():
            start = time.perf_counter()
            recipe = method.split("+")[0]
            cmd = [sys.executable, "-m", f"recipes.{recipe}", str(cfg), *common, *extra, f"run.run_dir={tmp}/run"]
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            seconds = time.perf_counter() - start
            found = LINE.search(out.stdout)
            if out.returncode or found is None:
                print(f"| {method} | failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]} |", flush=True)
                continue
            rows = re.search(r"(\d+ packed rows x \d+ tokens)", out.stdout)
            shape = rows.group(1).replace(" packed rows", "") if rows else "?"
            a, o, t, total = found.groups()
            print(f"| {method} | {shape} | {a} | {o} | {t} | {total} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
