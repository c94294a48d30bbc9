"""The coding stage of `make demo-agent`: a tiny model learns, with GRPO, to fix one-line Python bugs in the sandboxed
coding environment (`rollout/coding_env.py`).

    python -m recipes.quickstart --method coding [--run-dir runs/quickstart_coding] [--seed S]

1. tasks generated offline (`rollout.coding_env.coding_tasks`: six kinds of planted bug, a constant per task, 48
   distinct tasks in all: the GRPO prompts are the kinds the fine-tuning showed, with other draws);
2. a byte-level BPE tokenizer on the rendered conversations (ChatML, the three tools' schemas in the system turn);
3. SFT, from a random init, on a sloppy coder's conversations: it reads `solution.py`, writes it back and answers;
   it writes the fix `RIGHT_SHARE` of the time and the file unchanged otherwise, so the fine-tuned model's likeliest
   write leaves the bug while sampling writes some fixes: what GRPO can reinforce;
4. GRPO in the coding environment (the vLLM sampler on Ray, episodes of up to 3 turns, every tool call and the
   verifier's hidden tests in a sandbox; the verifier's 1 or 0 is the only reward).

The pass rate of each step's sampled episodes (the verifier's reward) is printed, saved to `quickstart_coding.json`
and plotted (`quickstart_coding.png`). A finished stage is not redone; a finished quickstart prints its result again.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from recipes.quickstart import write_jsonl
from recipes.quickstart_tools import CONFIGS, chat_tokenizer, conclude, fine_tune, finished

SUMMARY = "quickstart_coding.json"
RIGHT_SHARE = 0.3  # how often the sloppy coder writes the fix (else it writes the file back unchanged)


def fixed_source(row: dict) -> str:
    """The task's `solution.py` with the right body."""
    from rollout.coding_env import BUGS

    name, k = row["task"].rsplit("-", 1)
    right = next(r for n, r, _, _ in BUGS if n == name)
    return f"def {name}(x):\n    return {right.replace('K', k)}\n"


def sloppy_fix(row: dict, rng: random.Random, right_share: float = RIGHT_SHARE) -> list[dict]:
    """The sloppy coder's conversation on a task, as the coding environment would run it: the task, read_file, its
    text, write_file (the fix, or the file as it was), the write's acknowledgement, the answer."""
    from rollout.coding_env import SOLUTION

    files = row["files"]
    written = fixed_source(row) if rng.random() < right_share else files[SOLUTION]

    def call(name: str, **arguments) -> dict:
        function = {"name": name, "arguments": arguments}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}

    return [
        {"role": "user", "content": f"{row['prompt']}\n\nFiles: {', '.join(sorted(files))}."},
        call("read_file", path=SOLUTION),
        {"role": "tool", "name": "read_file", "content": files[SOLUTION]},
        call("write_file", path=SOLUTION, content=written),
        {"role": "tool", "name": "write_file", "content": f"wrote {len(written)} characters to {SOLUTION}"},
        {"role": "assistant", "content": "Done."},
    ]


def main(out: Path, seed: int, grpo_steps: int | None = None, sft_steps: int | None = None) -> int:
    from rollout.coding_env import SCHEMAS, coding_tasks

    settings = {"method": "coding", "seed": seed, "grpo_steps": grpo_steps, "sft_steps": sft_steps}
    done = out / SUMMARY
    if finished(done, settings, report):
        return 0
    start = time.perf_counter()
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)

    print("== 1/4 tasks (offline): one-line Python functions with a planted bug, visible and hidden tests", flush=True)
    rng = random.Random(seed)
    tools: list = list(SCHEMAS.values())
    chats = [{"messages": sloppy_fix(r, rng), "tools": tools} for r in coding_tasks(3000, seed=1)]
    sft = write_jsonl(data / "sft.jsonl", chats)
    rl = write_jsonl(data / "rl.jsonl", coding_tasks(2000, seed=1_000_000))

    print("== 2/4 tokenizer (ChatML with the tools' schemas)", flush=True)
    tokenizer = chat_tokenizer(out, chats, tools)
    print("== 3/4 fine-tuning on the sloppy coder's conversations (from a random init)", flush=True)
    fine_tune(out, "coding_sft.yml", sft, tokenizer, seed, sft_steps)

    print("== 4/4 GRPO in the sandboxed coding environment (the verifier's hidden tests the reward)", flush=True)
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from posttrain.config import PostTrainConfig
    from posttrain.fit import fit
    from posttrain.grpo import GRPO

    overrides = [
        f"run.run_dir={out / 'grpo'}",
        f"data.source={rl}",
        f"data.tokenizer_dir={tokenizer}",
        f"checkpoint.init_from={out / 'sft' / 'hf'}",
        f"run.seed={2 + seed}",
        *([f"train.steps={grpo_steps}"] if grpo_steps else []),
    ]
    fit(load_config(CONFIGS / "coding_grpo.yml", overrides, schema=PostTrainConfig), GRPO)
    rows = [r for r in read_metrics(out / "grpo") if "reward/environment/mean" in r]
    rates = [r["reward/environment/mean"] for r in rows]
    window = max(1, min(5, len(rates) // 4))
    result = {
        "settings": settings,
        "pass_rate": [round(x, 4) for x in rates],
        "first": sum(rates[:window]) / window,
        "last": sum(rates[-window:]) / window,
        "window": window,
        "turns": rows[-1].get("agent/turns"),
        "minutes": (time.perf_counter() - start) / 60,
        "plot": plot(out),
    }
    return conclude(done, result, report)


def plot(out: Path) -> str:
    """The pass rate of each GRPO step's sampled episodes, as logged (`core.metrics.plot_curves`)."""
    from core.metrics import plot_curves

    path = out / "quickstart_coding.png"
    plot_curves(out / "grpo", keys=("reward/environment/mean",), out=str(path.absolute()), ylabel="pass rate")
    return str(path.absolute())


def report(summary: dict) -> None:
    w = summary["window"]
    print(
        f"pass rate of the sampled episodes (the verifier's hidden tests): {summary['first']:.1%} over the first {w} "
        f"GRPO steps -> {summary['last']:.1%} over the last {w} ({len(summary['pass_rate'])} steps)"
    )
    print(f"total {summary['minutes']:.1f} min; curve: {summary['plot']}")
