"""GRPO step time: Temper (vLLM samplers on Ray, or the JAX sampler in-process) vs TRL's GRPOTrainer, same run.

    python bench/grpo_step.py                      # tiny and ~100M models
    python bench/grpo_step.py --sizes tiny --steps 3

For each model size the same step is run by both: `prompts` prompts x
`generations` completions of at most `max_tokens` tokens on reasoning-gym
arithmetic prompts, one optimizer update, no KL, float32, 2 CPU cores. The
reward is a length reward (`bench/bench_rewards.py:char_length`, the same
function on both sides): random models score it with variance in every group,
so every advantage is non-zero and both sides do the whole step (a math reward
scores every completion of a random model 0, and a step of zero advantages has
nothing to learn: Temper then skips the optimizer update). Each side's reward
spread is reported, and a run where Temper found a group without variance says
so (`--reward digit_share`, a task-like reward, leaves a few groups flat). Temper's step
time and its breakdown (generate / reward / train / sync) come from its metrics; TRL runs in its own virtual environment
(`.venv-trl`, created on first use with `pip install trl`) so it never touches
Temper's dependencies. The first step of each (compilation, warm-up) is left
out of the means; the median is printed too, and so are Temper's compilations in the timed steps (none is the
goal: `core.shape_plan` compiles the shapes a run grows into ahead), its goodput and its time to the first step.
Each part of Temper's step is printed beside its floor on this machine (`bench/floors.py`, measured in the same
process): generation against reading the weights once per decode step (plus the prompts' and samples' FLOPs at the
matmul peak; and, beside it, the same FLOPs at the rate XLA's GEMM reaches at a decode step's shape, a matmul with
one row a completion, measured here), the update against its FLOPs (6N + attention per trained token) at the matmul
peak plus AdamW's bytes (7 x 4N) at the read bandwidth, the weight sync against a copy of the 4N bytes. Run it as
`make bench-grpo` (Temper with huge-page malloc, see core/host_memory.py; TRL without, which is faster for it).
Goals (issue 54): Temper's step <= 0.3x TRL's with the JAX sampler, <= 0.4x with vLLM on Ray, at ~100M.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    # name: model overrides (vocab 512, tied embeddings, Qwen2 family as in grpo_tiny.yml)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
    "100M": dict(hidden_size=768, intermediate_size=2560, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64),
}


def trl_python() -> Path:
    python = ROOT / ".venv-trl" / "bin" / "python"
    # The CPU build of the torch vLLM pins (pip would otherwise take a CUDA build), the TRL the figures used, and
    # the PEFT that LoRA's peer side trains with (bench/lora_step.py).
    packages = ["torch==2.13.0", "trl==1.16.0", "math-verify", "peft==0.21.2"]
    if not python.exists():
        print("creating .venv-trl (pip install trl) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(ROOT / ".venv-trl")], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    elif subprocess.run([str(python), "-c", "import peft"], capture_output=True).returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)  # a venv from before peft
    return python


def build(size: str, work: Path, tokenizer: str) -> tuple[Path, Path, int]:
    """An HF model directory for `size`, a prompts file, and the model's parameter count."""
    from core.config_loader import load_config
    from core.hf.directory import save_hf
    from core.models import create_model, param_count
    from core.sources import reasoning_gym_records
    from posttrain.config import PostTrainConfig

    cfg = load_config(
        ROOT / "recipes" / "configs" / "grpo_tiny.yml",
        [f"model.{k}={v}" for k, v in SIZES[size].items()],
        schema=PostTrainConfig,
    )
    model = create_model(cfg.model, seed=0)
    print(f"{size}: {param_count(model) / 1e6:.1f}M parameters", flush=True)
    hf = save_hf(model, cfg.model, work / f"{size}_hf", tokenizer_dir=tokenizer)
    rows = reasoning_gym_records("basic_arithmetic", 256, seed=0)
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"question": r["question"], "answer": r["answer"], "prompt": f"{r['question']}\nAnswer:"}) + "\n"
            for r in rows
        )
    )
    return hf, prompts, param_count(model)


REWARDS = ROOT / "bench" / "bench_rewards.py"


def temper_step(size: str, sampler: str, hf: Path, prompts: Path, tokenizer: str, args, work: Path) -> dict:
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from posttrain.config import PostTrainConfig
    from posttrain.fit import fit
    from posttrain.grpo import GRPO

    run_dir = work / f"temper_{size}_{sampler}"
    cfg = load_config(
        ROOT / "recipes" / "configs" / "grpo_tiny.yml",
        [
            f"run.run_dir={run_dir}",
            f"checkpoint.init_from={hf}",
            f"data.source={prompts}",
            f"data.tokenizer_dir={tokenizer}",
            f"train.steps={args.steps + 1}",
            f"rl.batch.prompts_per_step={args.prompts}",
            f"rl.batch.num_generations={args.generations}",
            f"rollout.max_tokens={args.max_tokens}",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
            "data.eval_fraction=0.0",
            "optim.learning_rate=1.0e-5",
            f"rollout.sampler={sampler}",
            f"reward.functions=[{{fn: '{REWARDS}:{args.reward}'}}]",
            "rl.accuracy_fn=null",
        ],
        schema=PostTrainConfig,
    )
    fit(cfg, GRPO)
    rows = [r for r in read_metrics(run_dir) if "time/step_s" in r][1:]
    timing = json.loads((run_dir / "run_info.json").read_text())["time"]
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    flat = sum(r["zero_variance_groups"] for r in rows)
    if flat:
        print(f"warning: {flat:.0f} groups without reward variance over {len(rows)} steps (they skip the policy term)")
    last = read_metrics(run_dir)[-1]
    if last["empty_updates"] or last["skipped_updates"]:  # a step that applied no update did not do the work
        raise SystemExit(
            f"Temper skipped {last['empty_updates']:.0f} empty and {last['skipped_updates']:.0f} non-finite updates: "
            f"the measurement is not of the whole step"
        )
    out = {
        k.split("/")[1]: mean(k)
        for k in ("time/step_s", "time/generate_s", "time/reward_s", "time/train_s", "time/update_s", "time/sync_s")
    }
    return {
        **out,
        "median_step_s": statistics.median(r["time/step_s"] for r in rows),
        "rows": mean("pack/rows"),
        "fill": mean("pack/fill"),
        "reward_mean": mean("reward/mean"),
        "reward_std": mean("reward/std"),
        "zero_variance_groups": flat,
        "flat_group_share": flat / (len(rows) * args.prompts),
        "trained_tokens": mean("pack/rows") * cfg.rollout.max_model_len * mean("pack/fill"),
        "timed_compilations": sum(r["compile/compilations"] for r in rows),
        "timed_cache_loads": sum(r["compile/cache_hits"] for r in rows),  # compiled before, loaded while it waited
        "timed_compile_s": sum(r["time/compile"] for r in rows),
        **{k: timing[k] for k in ("goodput", "time_to_first_step_s", "run_compile_s")},
    }


def floors_of(size: str, floors, args, ours: dict, params: int) -> dict[str, float]:
    """The floors of each part of Temper's step at this size (module docstring)."""
    from bench.floors import rows_matmul_rate
    from core.config import ModelConfig
    from core.metrics import model_flops_per_token

    model = ModelConfig(**{"family": "qwen2", "vocab_size": 512, "tie_word_embeddings": True, **SIZES[size]})
    completions = args.prompts * args.generations
    weights = 4.0 * params
    decode = args.max_tokens * max(floors.read(weights), floors.flops(2.0 * params * completions))
    prefill = floors.flops(2.0 * params * args.prompts * 16)  # ~16 prompt tokens each
    update = floors.flops(model_flops_per_token(model, 128) * ours["trained_tokens"]) + floors.read(7 * weights)
    # What XLA:CPU's GEMM reaches at a decode step's shape (its rows: the completions), measured here: the
    # generation's time if every decode matmul ran at that rate (a kernel's bound, above the machine's floor).
    rate = rows_matmul_rate(completions, model.hidden_size, model.intermediate_size)
    kernel = args.max_tokens * 2.0 * params * completions / rate + prefill
    return {
        "generate": decode + prefill,
        "update": update,
        "sync": floors.copy(weights),
        "generate_kernel": kernel,
        "decode_matmul_flops": rate,
    }


def trl_step(hf: Path, prompts: Path, args, work: Path) -> dict:
    out = work / "trl.json"
    cmd = [
        str(trl_python()),
        str(ROOT / "bench" / "trl_grpo_step.py"),
        "--model",
        str(hf),
        "--prompts",
        str(prompts),
        "--steps",
        str(args.steps + 1),
        "--prompts-per-step",
        str(args.prompts),
        "--generations",
        str(args.generations),
        "--max-tokens",
        str(args.max_tokens),
        "--reward",
        args.reward,
        "--out",
        str(out),
    ]
    # TRL runs in its default environment: huge-page malloc (core/host_memory.py) makes torch slower here
    # (100M: 4.77 -> 5.03 s/step), so TRL is measured without it.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(out.read_text())
    times = result["step_times"][1:]
    return {
        "step_s": sum(times) / len(times),
        "median_step_s": statistics.median(times),
        "reward_mean": result["reward_mean"],
        "reward_std": result["reward_std"],
        "flat_group_share": result["frac_reward_zero_std"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--steps", type=int, default=8, help="timed steps (after one warm-up step)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reward", default="char_length", choices=["char_length", "digit_share"], help="bench_rewards.py")
    p.add_argument(
        "--samplers",
        nargs="+",
        default=["vllm", "jax"],
        choices=["vllm", "jax"],
        help="Temper's sampler: vLLM actors on Ray, and/or the JAX sampler in the trainer's process",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "grpo_step.json"))
    args = p.parse_args()

    from bench.floors import Floors
    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    floors = Floors.measure()
    print(floors.line(), flush=True)
    results: dict = {"floors": vars(floors)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = str(
            build_tokenizer([r["text"] for r in reasoning_gym_records("basic_arithmetic", 500, 0)], work / "tok", 512)
        )
        for size in args.sizes:
            hf, prompts, params = build(size, work, tokenizer)
            theirs = trl_step(hf, prompts, args, work)
            results[size] = {"trl": theirs}
            for sampler in args.samplers:
                ours = temper_step(size, sampler, hf, prompts, tokenizer, args, work)
                ratio = ours["step_s"] / theirs["step_s"]
                floor = floors_of(size, floors, args, ours, params)
                results[size][sampler] = {"temper": ours, "ratio": ratio, "floors": floor}
                print(
                    f"{size} [{sampler} sampler]: Temper {ours['step_s']:.2f} s/step (median "
                    f"{ours['median_step_s']:.2f}; generate {ours['generate_s']:.2f}, reward {ours['reward_s']:.2f}, "
                    f"train {ours['train_s']:.2f} of which update {ours['update_s']:.2f}, sync {ours['sync_s']:.2f}; "
                    f"reward {ours['reward_mean']:.3f} +- {ours['reward_std']:.3f}, flat groups "
                    f"{ours['flat_group_share']:.0%}) | TRL {theirs['step_s']:.2f} s/step (median "
                    f"{theirs['median_step_s']:.2f}; reward {theirs['reward_mean']:.3f} +- {theirs['reward_std']:.3f}, "
                    f"flat groups {theirs['flat_group_share']:.0%}) | ratio {ratio:.2f}",
                    flush=True,
                )
                print(
                    f"  floors: generate {floor['generate']:.2f} s ({floor['generate'] / ours['generate_s']:.0%} of "
                    f"Temper's; {floor['generate_kernel']:.2f} s at the {args.prompts * args.generations}-row matmul's "
                    f"{floor['decode_matmul_flops'] / 1e9:.0f} GFLOP/s measured here), "
                    f"update {floor['update']:.2f} s ({floor['update'] / ours['update_s']:.0%}), sync "
                    f"{floor['sync']:.3f} s ({floor['sync'] / max(ours['sync_s'], 1e-9):.0%}) | "
                    f"{ours['timed_compilations']:.0f} compilations and {ours['timed_cache_loads']:.0f} cache loads in "
                    f"the timed steps "
                    f"({ours['timed_compile_s']:.2f} s), "
                    f"mean / median {ours['step_s'] / ours['median_step_s']:.2f}, goodput {ours['goodput']:.1%}, time "
                    f"to the first step {ours['time_to_first_step_s']:.1f} s",
                    flush=True,
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
