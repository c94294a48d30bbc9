"""Goodput of a multi-turn GRPO run on the tools demo's model: 30 steps with an empty compilation cache, then the
same run again, in a new process, on the cache the first filled.

    python bench/agent_goodput.py                    # after `make demo-tools`; both samplers
    python bench/agent_goodput.py --samplers jax --run-steps 30

The workload is bench/agent_step.py's (the demo's fine-tuned model, its GRPO problems, the calculator, the reward
`bench_rewards.answer_closeness`) over `--run-steps` steps. Goodput is the share of the steps' wall time (from the
first step's start to the last one's end) spent in steps, not waiting for a compilation; the start-up before the
first step (loading, Ray, the sampler's engine) is printed beside it as the time to the first step, with what the run
compiled and what it loaded from the cache (core/goodput.py). Goals (issue 54): goodput >= 90%; the second run
compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_step import ROOT, check_model, parser, temper_step
from core.goodput import summary_line


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(prompts=8)
    p.add_argument("--run-steps", type=int, default=30, help="steps in each run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_goodput.json"))
    p.add_argument("--one", nargs=3, metavar=("SAMPLER", "CACHE", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    check_model(args)
    if args.one:  # one run, in a process of its own (what a second run of a recipe is)
        sampler, cache, result = args.one
        work = Path(result).parent
        timing = temper_step(args, work, None, args.prompts, args.run_steps - 1, sampler, cache, Path(result).stem)
        Path(result).write_text(json.dumps(timing["time"]))
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for sampler in args.samplers:
            cache = work / f"cache_{sampler}"
            for run in ("empty cache", "warm cache"):
                result = work / f"{sampler}_{run.split()[0]}.json"
                subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", sampler, str(cache), str(result)],
                               check=True)  # fmt: skip
                t = results[f"{sampler} {run}"] = json.loads(result.read_text())
                print(
                    f"{sampler}, {run}: {summary_line(t, args.run_steps)}; "
                    f"{t['run_background_compile_s']:.1f} s compiling ahead in the background",
                    flush=True,
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
