"""The quickstart: from nothing to a model that GRPO (or online DPO) visibly improves, on 2 CPU cores.

    python -m recipes.quickstart [--run-dir runs/quickstart] [--seed S] [--grpo-steps N]     # `make demo`
    python -m recipes.quickstart --method dpo [--run-dir runs/quickstart_dpo]               # `make demo-dpo`
    python -m recipes.quickstart --method distill [--run-dir runs/quickstart_distill]       # `make demo-distill`
    python -m recipes.quickstart --method tools [--run-dir runs/quickstart_tools]           # `make demo-tools`
    python -m recipes.quickstart --method agent [--run-dir runs/quickstart_agent]           # `make demo-agent`
    python -m recipes.quickstart --method coding [--run-dir runs/quickstart_coding]         # `make demo-agent`, then

1. generate 2-term +/- problems offline with reasoning-gym (exact answers);
2. build a byte-level BPE tokenizer on them;
3. pretrain a tiny Qwen2-shaped model from scratch on "question / Answer: N" text (the core loop);
4. fine-tune it on formatted solutions: prompt "question\\nAnswer:", completion " N" (SFT). The
   solutions come from a sloppy solver that drops the minus sign of a negative answer 4 times in 5
   (`--sign-slip`): demonstrations with a systematic slip, an exact checker for the rewards;
5. GRPO it with the vLLM sampler on Ray and the math_verify reward, evaluating held-out
   greedy accuracy before and after: GRPO undoes what the slip taught. With `--method dpo`,
   online DPO instead: the same samples and reward, each prompt's best and worst sample a pair
   (`posttrain.dpo.online`).

Prints the accuracies, and leaves in the run directory each stage's run
(`pretrain/`, `sft/`, `grpo/` or `dpo/`), the reward / accuracy curves
(`grpo/reward.png`, `quickstart.png`), the final Hugging Face export (`grpo/hf`)
and the result (`quickstart.json`). An interrupted quickstart resumes where it
stopped; a finished one says so and prints its result again.
Configs: recipes/configs/quickstart/*.yml.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from core.errors import UserError

CONFIGS = Path(__file__).parent / "configs" / "quickstart"
TASK = dict(
    min_terms=2,
    max_terms=2,
    min_digits=1,
    max_digits=2,
    operators=("+", "-"),
    allow_parentheses=False,
    allow_negation=False,
)
SIGN_SLIP = 0.8


def problems(n: int, seed: int) -> list[dict]:
    from core.sources import reasoning_gym_records

    return reasoning_gym_records("basic_arithmetic", n, seed, **TASK)


def sloppy_answers(rows: list[dict], slip: float, seed: int = 0) -> list[str]:
    """The fine-tuning solver's answers: right, except that a negative answer loses its sign with
    probability `slip` (a systematic slip, like a careless student's)."""
    rng = random.Random(seed)
    return [r["answer"][1:] if r["answer"].startswith("-") and rng.random() < slip else r["answer"] for r in rows]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


SUMMARY = "quickstart.json"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.quickstart", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default=None, help="default: runs/quickstart (GRPO), else runs/quickstart_METHOD")
    p.add_argument(
        "--method",
        choices=("grpo", "dpo", "ppo", "distill", "tools", "agent", "coding"),
        default="grpo",
        help="stage 5: GRPO, online DPO or PPO (with a critic); distill: the GRPO model distilled into a smaller "
        "student (recipes/quickstart_distill.py); tools: a calculator learned with SFT and GRPO on harder problems "
        "(recipes/quickstart_tools.py); agent: the same with an agent written against the openai client; coding: "
        "one-line bugs fixed in the sandboxed coding environment (recipes/quickstart_coding.py)",
    )
    p.add_argument("--teacher-run", default="runs/quickstart", help="--method distill: the GRPO quickstart to distil")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="added to every stage's run.seed (model init, data order, sampling); the problems stay",
    )
    p.add_argument("--pretrain-steps", type=int, default=None, help="override pretrain.yml's train.steps")
    p.add_argument("--sft-steps", type=int, default=None, help="override sft.yml's train.steps")
    p.add_argument("--grpo-steps", type=int, default=None, help="override stage 5's train.steps (either method)")
    p.add_argument("--eval-prompts", type=int, default=None, help="override stage 5's rl.eval_prompts")
    p.add_argument(
        "--sign-slip",
        type=float,
        default=SIGN_SLIP,
        help="how often the fine-tuning solutions drop the minus sign of a negative answer (0: clean)",
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.sign_slip <= 1.0:
        p.error(f"--sign-slip must be a probability in [0, 1], got {args.sign_slip}")
    if args.method in ("tools", "agent", "coding"):  # their own pipeline (no pretraining, a sloppy agent, its figures)
        unused = [f"--{k.replace('_', '-')}" for k in ("pretrain_steps", "eval_prompts") if getattr(args, k)]
        unused += ["--sign-slip"] if args.sign_slip != SIGN_SLIP else []
        if unused:
            p.error(f"--method {args.method} does not take {', '.join(unused)}")
    if args.run_dir is None:
        args.run_dir = f"runs/quickstart_{args.method}" if args.method != "grpo" else "runs/quickstart"
    return args


METHODS = {"grpo": "GRPO", "dpo": "online DPO", "ppo": "PPO"}


def report(summary: dict) -> None:
    """The quickstart's result: held-out accuracy before and after stage 5, pass@k, maj@k, where things are."""
    before, after, k = summary["before"], summary["after"], summary["eval_samples"]
    method = METHODS[summary["settings"].get("method", "grpo")]
    if before is not None:
        print(
            f"held-out greedy accuracy: {before['eval/pass@1']:.1%} after SFT -> {after['eval/pass@1']:.1%} "
            f"after {summary['grpo_steps']} {method} steps "
            f"({100 * (after['eval/pass@1'] - before['eval/pass@1']):+.1f} points)"
        )
    print(
        f"sampled pass@{k}: {after[f'eval/pass@{k}']:.1%}, maj@{k}: {after[f'eval/maj@{k}']:.1%}; "
        f"total {summary['minutes']:.1f} min"
    )
    print(f"curves: {summary['plot']}; model: {summary['hf_dir']}")


def main(argv: list[str]) -> int:
    args = parse(argv)
    out = Path(args.run_dir)
    if args.method == "distill":
        from recipes import quickstart_distill

        return quickstart_distill.main(out, Path(args.teacher_run), args.seed)
    if args.method == "coding":
        from recipes import quickstart_coding

        return quickstart_coding.main(out, args.seed, args.grpo_steps, args.sft_steps)
    if args.method in ("tools", "agent"):
        from recipes import quickstart_tools

        return quickstart_tools.main(out, args.seed, args.grpo_steps, args.sft_steps, args.method)
    settings = {k: v for k, v in vars(args).items() if k not in ("run_dir", "teacher_run")}
    done = out / SUMMARY
    if done.exists():  # a finished quickstart: say so and show its result (nothing resumes, nothing is redone)
        summary = json.loads(done.read_text())
        summary["settings"].setdefault("method", "grpo")  # written before --method existed
        if summary["settings"] != settings:
            raise UserError(
                f"{out} holds a quickstart run with other settings ({summary['settings']}); use another --run-dir"
            )
        print(f"the quickstart in {out} is complete ({done}); its result:")
        report(summary)
        return 0

    def steps(flag: int | None, key: str = "train.steps") -> list[str]:
        return [] if flag is None else [f"{key}={flag}"]

    def seed(stage_seed: int) -> list[str]:
        return [f"run.seed={stage_seed + args.seed}"]

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    print("== 1/5 problems (reasoning-gym, offline)", flush=True)
    pretrain_rows = problems(20000, seed=1)
    sft_rows = problems(4000, seed=2)
    rl_rows = problems(4000, seed=3)
    # Pretraining documents are worksheets of four problems, so the pretrained model runs on past an answer
    # into the next problem; fine-tuning and then GRPO teach it to answer and stop.
    worked = [r["text"] for r in pretrain_rows]  # "question\nAnswer: N"
    corpus = write_jsonl(
        data / "pretrain.jsonl", [{"text": "\n".join(worked[i : i + 4])} for i in range(0, len(worked), 4)]
    )
    sft = write_jsonl(
        data / "sft.jsonl",
        [
            {"prompt": f"{r['question']}\nAnswer:", "completion": f" {answer}"}
            for r, answer in zip(sft_rows, sloppy_answers(sft_rows, args.sign_slip))
        ],
    )
    rl = write_jsonl(data / "rl.jsonl", [{k: r[k] for k in ("question", "answer", "metadata")} for r in rl_rows])

    print("== 2/5 tokenizer", flush=True)
    from core.tokenizer import tokenizer_for_run

    texts = (json.loads(line)["text"] for line in Path(corpus).read_text().splitlines())
    tokenizer = tokenizer_for_run(None, texts, out, 512)

    from recipes.pretrain import main as pretrain_main
    from recipes.sft import main as sft_main

    print("== 3/5 pretraining", flush=True)
    _check(
        pretrain_main(
            [
                str(CONFIGS / "pretrain.yml"),
                f"run.run_dir={out / 'pretrain'}",
                f"data.source={corpus}",
                f"data.tokenizer_dir={tokenizer}",
                *seed(0),
                *steps(args.pretrain_steps),
            ]
        )
    )
    print("== 4/5 fine-tuning on formatted solutions", flush=True)
    _check(
        sft_main(
            [
                str(CONFIGS / "sft.yml"),
                f"run.run_dir={out / 'sft'}",
                f"data.source={sft}",
                f"data.tokenizer_dir={tokenizer}",
                f"checkpoint.init_from={out / 'pretrain'}",
                *seed(1),
                *steps(args.sft_steps),
            ]
        )
    )

    print(f"== 5/5 {METHODS[args.method]} (vLLM sampler on Ray, math_verify reward)", flush=True)
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from posttrain.config import PostTrainConfig
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.fit import fit
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.method import SamplingMethod
    from posttrain.ppo import PPO

    stage = out / args.method
    overrides = [
        f"run.run_dir={stage}",
        f"data.source={rl}",
        f"data.tokenizer_dir={tokenizer}",
        f"checkpoint.init_from={out / 'sft' / 'hf'}",
        *seed(2),
        *steps(args.grpo_steps),
        *steps(args.eval_prompts, "rl.eval_prompts"),
        "train.eval_on_start=true",  # the fine-tuned model's accuracy, at step 0
    ]
    cfg = load_config(CONFIGS / f"{args.method}.yml", overrides, schema=PostTrainConfig)
    if cfg.train.steps % cfg.train.eval_every:  # an evaluation on the last step, whatever the step count
        overrides.append(f"train.eval_every={cfg.train.steps}")
        cfg = load_config(CONFIGS / f"{args.method}.yml", overrides, schema=PostTrainConfig)
    methods: dict[str, SamplingMethod] = {"grpo": GRPO, "dpo": ONLINE_DPO, "ppo": PPO}
    summary = fit(cfg, methods[args.method])
    # Every evaluation, a resumed stage 5's included: step 0 (after SFT) and the last step.
    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(stage)
             if "eval/pass@1" in r}  # fmt: skip
    before, after = evals.get(0), evals[summary.steps]
    from core.metrics import plot_curves

    plot = (out / "quickstart.png").absolute()
    plot_curves(stage, keys=("accuracy", "eval/pass@1", "eval/sampled_pass@1"), out=str(plot), ylabel="accuracy")
    result = {
        "settings": settings,
        "before": before,
        "after": after,
        "grpo_steps": summary.steps,
        "eval_samples": cfg.rl.eval_samples,
        "minutes": (time.perf_counter() - start) / 60,
        "plot": str(plot),
        "hf_dir": str(summary.hf_dir),
    }
    print()
    report(result)
    done.write_text(json.dumps(result, indent=2))
    return 0


def _check(rc: int) -> None:
    if rc:
        raise SystemExit(rc)


if __name__ == "__main__":
    from core.cli import run_cli

    sys.exit(run_cli(main, sys.argv[1:], supervise=True))
