"""GRPO's clipped objective vs CISPO vs SAPO, each with and without a rollout correction, on the quickstart task.

    .venv/bin/python bench/rl_objectives.py                          # every arm, seeds 0 1 2 (about 60 minutes)
    .venv/bin/python bench/rl_objectives.py --arms clip:off cispo:off --seeds 0 --steps 50

The quickstart's stages 1-4 (problems, tokenizer, pretraining, fine-tuning) run once into `OUT/base`; every arm then
runs the quickstart's GRPO stage (`recipes/configs/quickstart/grpo.yml`: 32 prompts x 8 samples a step, the
math_verify reward, greedy accuracy on 200 held-out prompts at steps 0, 50, 100 and 150) from that fine-tuned model,
with vLLM sampling in bfloat16 (the trainer in float32: the mismatch a correction is for is real) and one of
`rl.loss.type` x `rl.rollout_correction`, in four updates a step (`rl.batch.mini_batches=4`, TRL's
`steps_per_generation`): the first is at pi_old, the next three are off-policy. With one update a step the three
objectives are the same gradient (each is -A grad log pi at ratio 1), and the quickstart's config makes one. A
seed is the quickstart's `--seed` (run.seed 2 + seed: the sampling and the data order; the held-out prompts are the
same for every seed). An arm whose
`metrics.jsonl` is complete is read, not re-run: the script resumes where it stopped.

Written to OUT: `results.json` (every run's evaluations, its mean training reward over the last 30 steps, what the
correction acted on, its wall time), `table.md` (the arms' means and ranges over the seeds) and `objectives.png`
(greedy accuracy by step, each arm's mean over the seeds and its range). docs/grpo.md holds the last run's table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# An arm is `loss:correction`; each correction is the config value it sets.
CORRECTIONS = {
    "off": "{mode: off}",
    "token_truncate": "{mode: token_truncate, hi: 2.0}",  # Temper's default before this comparison
    "sequence_mask": "{mode: sequence_mask, hi: 3.0}",  # TRL's default since TRL #4530
    "geometric_mask": "{mode: geometric_mask, lo: 0.99, hi: 1.01}",  # SkyRL's recommended bounds
}
ARMS = (
    "clip:token_truncate",
    "clip:off",
    "clip:sequence_mask",
    "clip:geometric_mask",
    "cispo:off",
    "cispo:sequence_mask",
    "sapo:off",
    "sapo:sequence_mask",
)
CONFIG = ROOT / "recipes" / "configs" / "quickstart" / "grpo.yml"
TAIL = 30  # the training reward is averaged over the last TAIL steps


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/objectives", help="where the runs, results.json, table.md and the plot go")
    p.add_argument("--arms", nargs="+", default=list(ARMS), help=f"loss:correction (corrections: {list(CORRECTIONS)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150, help="GRPO steps a run (the quickstart's 150)")
    p.add_argument("--sampler-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--updates", type=int, default=4, help="optimizer updates a step (rl.batch.mini_batches)")
    args = p.parse_args(argv)
    for arm in args.arms:
        _, _, correction = arm.partition(":")
        if correction not in CORRECTIONS:
            p.error(f"arm {arm!r}: the correction is one of {list(CORRECTIONS)}")
    return args


def base(out: Path) -> Path:
    """The quickstart's stages 1-4 (its GRPO stage cut to one step, not used): the fine-tuned model."""
    if not (out / "sft" / "hf").exists():
        print(f"== the quickstart's stages 1-4 into {out}", flush=True)
        cmd = [sys.executable, "-m", "recipes.quickstart", "--run-dir", str(out), "--grpo-steps", "1"]
        subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def complete(run_dir: Path, steps: int) -> list[dict] | None:
    from core.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").exists():
        return None
    rows = read_metrics(run_dir)
    evals = {r["step"] for r in rows if "eval/pass@1" in r}
    return rows if steps in evals and 0 in evals else None


def run_arm(out: Path, arm: str, seed: int, args: argparse.Namespace) -> dict:
    loss, _, correction = arm.partition(":")
    run_dir = out / arm.replace(":", "-") / f"seed{seed}"
    rows = complete(run_dir, args.steps)
    wall = None
    if rows is None:
        overrides = [
            f"run.run_dir={run_dir}",
            f"run.seed={2 + seed}",
            f"data.source={out / 'base' / 'data' / 'rl.jsonl'}",
            f"data.tokenizer_dir={out / 'base' / 'tokenizer'}",
            f"checkpoint.init_from={out / 'base' / 'sft' / 'hf'}",
            f"train.steps={args.steps}",
            f"train.eval_every={min(50, args.steps)}",
            "train.eval_on_start=true",
            "checkpoint.export_hf=false",
            f"rollout.dtype={args.sampler_dtype}",
            f"rl.loss.type={loss}",
            f"rl.rollout_correction={CORRECTIONS[correction]}",
            f"rl.batch.mini_batches={args.updates}",
        ]
        print(f"== {arm} seed {seed}: {run_dir}", flush=True)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "recipes.grpo", str(CONFIG), *overrides], cwd=ROOT, check=True)
        wall = time.perf_counter() - start
        rows = complete(run_dir, args.steps)
        if rows is None:
            raise SystemExit(f"{run_dir}: the run ended without its step-{args.steps} evaluation")
    train = [r for r in rows if "reward/mean" in r]
    evals = {r["step"]: r["eval/pass@1"] for r in rows if "eval/pass@1" in r}

    def mean(key: str) -> float | None:
        values = [r[key] for r in train if key in r]
        return statistics.fmean(values) if values else None

    return {
        "arm": arm,
        "seed": seed,
        "eval": evals,
        "reward_tail": statistics.fmean(r["reward/mean"] for r in train[-TAIL:]),
        "masked_tokens": mean("correction/masked_tokens"),
        "truncated_tokens": mean("correction/truncated_tokens"),
        "ratio_min": min((r["correction/ratio_min"] for r in train if "correction/ratio_min" in r), default=None),
        "ratio_max": max((r["correction/ratio_max"] for r in train if "correction/ratio_max" in r), default=None),
        "clip_fraction": mean("clip_fraction"),
        "wall_s": wall,
    }


def table(results: list[dict], steps: int) -> str:
    def cell(values: list[float], pct: bool = True) -> str:
        k = 100 if pct else 1
        return f"{statistics.fmean(values) * k:.1f} ({min(values) * k:.1f}-{max(values) * k:.1f})"

    lines = [
        f"| loss | correction | greedy accuracy, step 0 | step {steps} | gain | training reward, last {TAIL} steps "
        "| tokens masked | tokens truncated | clip fraction |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in dict.fromkeys(r["arm"] for r in results):
        rs = [r for r in results if r["arm"] == arm]
        first, last = [r["eval"][0] for r in rs], [r["eval"][steps] for r in rs]
        share = {k: [r[k] for r in rs if r[k] is not None] for k in ("masked_tokens", "truncated_tokens")}
        loss, _, correction = arm.partition(":")
        lines.append(
            f"| {loss} | {correction} | {cell(first)} | {cell(last)} | "
            f"{cell([b - a for a, b in zip(first, last)])} | {cell([r['reward_tail'] for r in rs])} | "
            + " | ".join(f"{statistics.fmean(v) * 100:.2f}%" if v else "-" for v in share.values())
            + f" | {statistics.fmean(r['clip_fraction'] for r in rs) * 100:.2f}% |"
        )
    seeds = sorted({r["seed"] for r in results})
    lines.append(f"\nMean (min-max) over seeds {seeds}; accuracy and reward in percent.")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in dict.fromkeys(r["arm"] for r in results):
        rs = [r for r in results if r["arm"] == arm]
        steps = sorted(set.intersection(*(set(r["eval"]) for r in rs)))
        per = [[r["eval"][s] * 100 for r in rs] for s in steps]
        line = ax.plot(steps, [statistics.fmean(v) for v in per], marker="o", label=f"{arm} ({len(rs)} seeds)")[0]
        ax.fill_between(steps, [min(v) for v in per], [max(v) for v in per], color=line.get_color(), alpha=0.12)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("greedy accuracy, held-out prompts (%)")
    ax.set_title("quickstart task: loss x rollout correction (vLLM in bfloat16)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = parse(argv)
    out = Path(args.out).absolute()
    base(out / "base")
    results = []
    for seed in args.seeds:  # seed-major: a stopped comparison has every arm on its first seeds
        for arm in args.arms:
            results.append(run_arm(out, arm, seed, args))
            (out / "results.json").write_text(json.dumps(results, indent=1))
    results.sort(key=lambda r: (args.arms.index(r["arm"]), r["seed"]))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, args.steps)
    (out / "table.md").write_text(text + "\n")
    plot(results, out / "objectives.png")
    print(text)
    print(f"written: {out / 'results.json'}, {out / 'table.md'}, {out / 'objectives.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
