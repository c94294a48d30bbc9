"""The multi-turn GRPO step with a calculator tool: Temper (vLLM on Ray, and the JAX sampler) vs TRL's GRPOTrainer
(`tools=`),
and Temper's trajectories per second with `rl.agent.max_concurrency` 1 vs 16.

    python bench/agent_step.py                       # after `make demo-tools` (its fine-tuned model)
    python bench/agent_step.py --steps 3 --prompts 4 --generations 8
    python bench/agent_step.py --compare endpoint    # built-in environment vs endpoint vs TRL environment_factory

The model is `make demo-tools`' fine-tuned one (runs/quickstart_tools/sft/hf): it calls the calculator, reads its
result and answers, so episodes take real turns; a random model would stop after one. The prompts are the demo's
GRPO problems (3- and 4-digit sums). Both sides do the same step: `prompts` x `generations` episodes of at most
`max_turns` model turns (`max_tokens` each; TRL's completion budget is `max_turns x max_tokens`), Temper's
`calculator` (the same Python function, its schema from transformers' `get_json_schema`) answering each call, the
reward `bench_rewards.answer_closeness` on the last turn (1 for the exact answer, partial credit by the last
number's relative error: groups rarely score flat, so every step updates; `--reward final_answer` is exact-or-0),
one optimizer update (no KL), float32, 2 CPU cores. TRL runs
in its own virtual environment (`.venv-trl`, as bench/grpo_step.py) with transformers `generate`; Temper samples
with vLLM on Ray, each episode's turns as their own requests, and with the JAX sampler (`--samplers`), its engine
(`rollout.jax_engine`) decoding every episode in a slot of its own. Each side's tool calls, tokens a trajectory,
reward and share of flat groups are printed beside its time, so a step that did less work shows, and so are
Temper's compilations and loads from the persistent cache in the timed steps (counted by `core.compile_cache`: none
is the goal), the run's goodput and its time to the first step. The first step (warm-up) is left out of the means.
Goals (issue 54): no timed step compiles; each side's mean within 1.15x of its median; the JAX sampler's mean
<= 0.7x TRL's.
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

from bench.grpo_step import trl_python  # noqa: E402
from recipes.quickstart_tools import AGENT_OVERRIDE  # noqa: E402

DEMO = ROOT / "runs" / "quickstart_tools"
REWARDS = ROOT / "bench" / "bench_rewards.py"


def temper_step(
    args, work: Path, concurrency: int | None, prompts: int, steps: int, sampler: str = "vllm", cache: str = "",
    tag: str = "", agent: str = "environment",
) -> dict:  # fmt: skip
    """`steps` timed steps after a warm-up one; `cache`: a compilation cache directory (empty: the user's default).
    `agent`: the built-in `tools` environment's episodes, or `program`: the same calculator agent written against
    the `openai` client (recipes/calculator_agent.py, at most 3 calls) through the run's endpoint."""
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from posttrain.config import PostTrainConfig
    from posttrain.fit import fit
    from posttrain.grpo import GRPO

    run_dir = work / f"temper_{sampler}_{agent}_{concurrency}_{prompts}{tag}"
    cfg = load_config(
        ROOT / "recipes" / "configs" / "quickstart" / "tools_grpo.yml",
        [
            f"run.run_dir={run_dir}",
            f"checkpoint.init_from={args.model}",
            f"data.source={args.data}",
            f"data.tokenizer_dir={args.tokenizer}",
            f"train.steps={steps + 1}",
            f"rl.batch.prompts_per_step={prompts}",
            f"rl.batch.num_generations={args.generations}",
            f"rl.agent.max_turns={args.max_turns}",
            f"rl.agent.max_concurrency={concurrency or 'null'}",
            f"rollout.sampler={sampler}",
            f"rollout.max_tokens={args.max_tokens}",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
            "data.eval_fraction=0.0",
            "optim.learning_rate=1.0e-5",
            f"reward.functions=[{{fn: '{REWARDS}:{args.reward}'}}]",
            "rl.accuracy_fn=null",
            *([f"compile.cache_dir={cache}"] if cache else []),
            *([AGENT_OVERRIDE] if agent == "program" else []),
        ],
        schema=PostTrainConfig,
    )
    fit(cfg, GRPO)
    rows = [r for r in read_metrics(run_dir) if "time/step_s" in r][1:]
    timing = json.loads((run_dir / "run_info.json").read_text())["time"]
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    last = read_metrics(run_dir)[-1]
    if last["empty_updates"] or last["skipped_updates"]:  # a step that applied no update did not do the work
        raise SystemExit(
            f"Temper skipped {last['empty_updates']:.0f} empty and {last['skipped_updates']:.0f} non-finite updates: "
            "the measurement is not of the whole step"
        )
    episodes = prompts * args.generations
    return {
        **{k.split("/")[1]: mean(k) for k in ("time/step_s", "time/generate_s", "time/train_s", "time/sync_s")},
        "median_step_s": statistics.median(r["time/step_s"] for r in rows),
        "step_times": [round(r["time/step_s"], 3) for r in rows],
        "train_times": [round(r["time/train_s"], 3) for r in rows],
        "generate_times": [round(r["time/generate_s"], 3) for r in rows],
        "trajectories_per_s": episodes / mean("time/generate_s"),
        "turns": mean("agent/turns"),
        "tool_calls": mean("agent/tool_calls"),
        "tool_errors": mean("agent/tool_errors"),
        "model_tokens": mean("agent/model_tokens"),
        "env_tokens": mean("agent/env_tokens"),
        "reward_mean": mean("reward/mean"),
        "flat_group_share": sum(r["zero_variance_groups"] for r in rows) / (len(rows) * prompts),
        "timed_compilations": sum(r["compile/compilations"] for r in rows),
        "timed_cache_loads": sum(r["compile/cache_hits"] for r in rows),  # compiled before, loaded while it waited
        "timed_compile_s": sum(r["time/compile"] for r in rows),
        "goodput": timing["goodput"],
        "time_to_first_step_s": timing["time_to_first_step_s"],
        "run_compile_s": timing["run_compile_s"],
        "time": timing,
    }


def trl_step(args, work: Path, environment: bool = False) -> dict:
    """TRL's step with the calculator as `tools=`, or as an `environment_factory` class."""
    out = work / "trl.json"
    cmd = [
        str(trl_python()),
        str(ROOT / "bench" / "trl_agent_step.py"),
        *("--model", str(args.model), "--prompts", str(args.data), "--steps", str(args.steps + 1)),
        *("--prompts-per-step", str(args.prompts), "--generations", str(args.generations)),
        *("--max-turns", str(args.max_turns), "--max-tokens", str(args.max_tokens), "--out", str(out)),
        *("--reward", args.reward),
        *(["--environment"] if environment else []),
    ]
    # TRL runs in its default environment (no huge-page malloc: bench/grpo_step.py measured torch slower with it).
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(out.read_text())
    times = result["step_times"][1:]
    return {**result, "step_s": sum(times) / len(times), "median_step_s": statistics.median(times)}


def parser(description: str) -> argparse.ArgumentParser:
    """The workload's options, shared with bench/agent_goodput.py."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=str(DEMO / "sft" / "hf"), help="a tool-calling model (make demo-tools')")
    p.add_argument("--tokenizer", default=str(DEMO / "tokenizer"))
    p.add_argument("--data", default=str(DEMO / "data" / "rl.jsonl"), help="rows with question and answer")
    p.add_argument("--steps", type=int, default=8, help="timed steps (after one warm-up step)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--throughput-prompts", type=int, default=16, help="prompts a step for the concurrency figures")
    p.add_argument("--reward", default="answer_closeness", help="a function of bench/bench_rewards.py")
    p.add_argument("--samplers", nargs="+", default=["vllm", "jax"], choices=["vllm", "jax"], help="Temper's sides")
    return p


def check_model(args) -> None:
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"no model at {args.model}: run `make demo-tools` first (its fine-tuned model calls the tool)")


def endpoint_comparison(args, work: Path) -> dict:
    """The endpoint path (`--compare endpoint`): Temper's built-in environment and the same agent written against
    the `openai` client through the endpoint, both on vLLM, beside TRL's `environment_factory`, in one run."""
    sides = {
        "environment": temper_step(args, work, None, args.prompts, args.steps),
        "endpoint": temper_step(args, work, None, args.prompts, args.steps, agent="program"),
    }
    trl = trl_step(args, work, environment=True)
    for name, o in sides.items():
        print(
            f"Temper, vLLM, {name}: {o['step_s']:.2f} s a step (median {o['median_step_s']:.2f}; generate "
            f"{o['generate_s']:.2f}, train {o['train_s']:.2f}) | {o['trajectories_per_s']:.1f} trajectories/s | "
            f"{o['turns']:.2f} turns, {o['tool_calls']:.2f} calls, reward {o['reward_mean']:.2f} | "
            f"{o['timed_compilations']:.0f} compilations in the timed steps | "
            f"ratio to TRL {o['step_s'] / trl['step_s']:.2f}",
            flush=True,
        )
    episodes = args.prompts * args.generations
    print(
        f"TRL environment_factory: {trl['step_s']:.2f} s a step (median {trl['median_step_s']:.2f}) | "
        f"{episodes / trl['step_s']:.1f} trajectories/s of the whole step | {trl['tool_calls']:.2f} calls, "
        f"reward {trl['reward_mean']:.2f}",
        flush=True,
    )
    return {**sides, "trl_environment_factory": trl}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_step.json"))
    p.add_argument(
        "--compare",
        choices=["samplers", "endpoint"],
        default="samplers",
        help="samplers: TRL tools= vs Temper's samplers, and concurrency; endpoint: Temper's built-in environment "
        "vs its endpoint (the agent written against the openai client) vs TRL environment_factory",
    )
    args = p.parse_args()
    check_model(args)
    if args.compare == "endpoint":
        with tempfile.TemporaryDirectory() as tmp:
            results = endpoint_comparison(args, Path(tmp))
        out = Path(args.out).with_name("agent_step_endpoint.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
        return

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # The step, the sides interleaved (TRL, Temper with each sampler, TRL again) so that drift of the machine
        # shows.
        trl = [trl_step(args, work)]
        ours = {s: temper_step(args, work, None, args.prompts, args.steps, s) for s in args.samplers}
        trl.append(trl_step(args, work))
        theirs = statistics.mean(t["step_s"] for t in trl)
        trl_times = " / ".join(f"{t['step_s']:.2f}" for t in trl)
        results["step"] = {"trl": trl, **{s: {"temper": o, "ratio": o["step_s"] / theirs} for s, o in ours.items()}}
        print(
            f"TRL {trl_times} s a step ({trl[0]['tool_calls']:.2f} calls, {trl[0]['completion_length']:.1f} tokens a "
            f"trajectory, reward {trl[0]['reward_mean']:.2f}, flat groups {trl[0]['frac_reward_zero_std']:.0%})",
            flush=True,
        )
        for sampler, o in ours.items():
            print(
                f"agent GRPO step ({args.prompts} prompts x {args.generations}, <= {args.max_turns} turns), Temper "
                f"with {sampler}: {o['step_s']:.2f} s (median {o['median_step_s']:.2f}; generate "
                f"{o['generate_s']:.2f}, train {o['train_s']:.2f}, sync {o['sync_s']:.2f}; {o['turns']:.2f} turns, "
                f"{o['tool_calls']:.2f} calls, {o['model_tokens'] + o['env_tokens']:.1f} tokens a trajectory, reward "
                f"{o['reward_mean']:.2f}, flat groups {o['flat_group_share']:.0%}) | ratio to TRL "
                f"{results['step'][sampler]['ratio']:.2f} | mean / median {o['step_s'] / o['median_step_s']:.2f} | "
                f"{o['timed_compilations']:.0f} compilations and {o['timed_cache_loads']:.0f} cache loads in the timed "
                f"steps ({o['timed_compile_s']:.2f} s) | "
                f"goodput {o['goodput']:.1%}, time to the first step {o['time_to_first_step_s']:.1f} s",
                flush=True,
            )
        # Trajectories per second through the vLLM sampler: one episode at a time vs 16 at once.
        for concurrency in (1, 16):
            got = temper_step(args, work, concurrency, args.throughput_prompts, 2)
            results[f"concurrency_{concurrency}"] = got
            print(
                f"max_concurrency {concurrency}: {got['trajectories_per_s']:.1f} trajectories/s "
                f"({args.throughput_prompts * args.generations} a step, {got['turns']:.2f} turns each)",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
