"""The tools quickstart: a tiny model learns to use a calculator for arithmetic it cannot do in its head.

    python -m recipes.quickstart --method tools [--run-dir runs/quickstart_tools] [--seed S]     # `make demo-tools`
    python -m recipes.quickstart --method agent [--run-dir runs/quickstart_agent]                 # `make demo-agent`

1. 2-term +/- problems with 3- and 4-digit numbers, generated offline with reasoning-gym (exact answers): a
   4-layer, 128-wide model trained for minutes gets almost none of them right in its head;
2. a byte-level BPE tokenizer on the rendered conversations, with Temper's ChatML template, which writes the
   calculator's JSON schema into the system turn and tool calls as Qwen2.5 does (`<tool_call>{...}</tool_call>`,
   read back by vLLM's `hermes` parser);
3. SFT, from a random init, on the traces of a sloppy agent: it calls the calculator with the problem's
   expression, reads the result and answers with it, or answers in its head, wrong by a digit; it trusts its
   head with sums (75% of them) and calls the tool on most differences (`SKIP_TOOL`). The fine-tuned model
   guesses most sums when decoding greedily, and copies operands and results imperfectly;
4. GRPO with the tool (`rl.agent`: the built-in `tools` environment with the `calculator`; episodes of up to 3
   turns on the vLLM sampler on Ray, the math_verify reward on the final answer);
5. GRPO without the tool, the same budget from the same fine-tuned model: one completion a prompt, the answer
   in its head.

With `--method agent` (`make demo-agent`), stages 1-3 and one GRPO arm whose episodes are the calculator agent of
`recipes/calculator_agent.py`, written against the `openai` client (`rl.agent.program`): the run serves its samplers
behind an OpenAI-compatible endpoint, the agent calls it and runs the calculator itself, and GRPO trains on what
its calls sampled (token in / token out).

Held-out greedy accuracy (math_verify, the same 200 problems) after SFT and after each GRPO arm is printed, saved
to `quickstart_<method>.json` and plotted (`quickstart_<method>.png`: the arms' held-out accuracy over the steps). A
finished stage is not redone; a finished quickstart prints its result again.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from recipes import quickstart
from recipes.quickstart import _check, write_jsonl

CONFIGS = Path(__file__).parent / "configs" / "quickstart"
TASK = {**quickstart.TASK, "min_digits": 3, "max_digits": 4}  # the quickstart's problems, with wider numbers
# How often the sloppy agent answers in its head instead of calling the calculator: it trusts its head with sums
# and reaches for the tool on differences. So the fine-tuned model's most likely first move on a sum is a guess
# (wrong: greedy decoding misses most sums), while sampling still calls the tool on some: what GRPO can reinforce.
SKIP_TOOL = {"+": 0.75, "-": 0.1}


def tool_problems(n: int, seed: int) -> list[dict]:
    from core.sources import reasoning_gym_records

    return reasoning_gym_records("basic_arithmetic", n, seed, **TASK)


def split_problems(n_sft: int, n_rl: int) -> tuple[list[dict], list[dict]]:
    """SFT's problems and GRPO's (whose held-out share is the evaluation), with no question in both: reasoning-gym
    seeds problem i with `seed + i`, so nearby seeds give shifted copies of one list (seeds 2 and 3 shared every
    problem); the two lists come from seeds far apart, and GRPO's drop any question SFT has."""
    sft = tool_problems(n_sft, seed=2)
    seen = {r["question"] for r in sft}
    return sft, [r for r in tool_problems(n_rl, seed=1_000_000) if r["question"] not in seen]


def expression(question: str) -> str:
    """ "Calculate 4286 + 603." -> "4286 + 603"."""
    return question.removeprefix("Calculate ").rstrip(".")


def in_the_head(answer: str, rng: random.Random) -> str:
    """A mental-arithmetic answer: the right one with one digit wrong."""
    digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
    i = rng.choice(digits)
    wrong = rng.choice([d for d in "0123456789" if d != answer[i]])
    return answer[:i] + wrong + answer[i + 1 :]


def end_turns_with_im_end(tokenizer_dir: str) -> None:
    """Make the chat template's end of turn (`<|im_end|>`) the tokenizer's EOS, as chat models ship (Qwen2.5's
    instruct tokenizer): a sampled turn then stops there, and the environment's reply is appended after it."""
    from core.tokenizer import IM_END, open_tokenizer

    tok = open_tokenizer(tokenizer_dir)
    if tok.eos_token != IM_END:
        tok.eos_token = IM_END
        tok.save_pretrained(tokenizer_dir)


def operation(question: str) -> str:
    """ "Calculate 4286 + 603." -> "+"; "Calculate 953 - 43." -> "-"."""
    return "-" if " - " in expression(question) else "+"


def sloppy_trace(row: dict, rng: random.Random, skip_tool: dict[str, float]) -> list[dict]:
    """The sloppy agent's conversation on one problem: the calculator and its answer, or a guess (with the
    probability `skip_tool` gives the problem's operation)."""
    from rollout.calculator import calculator

    user = {"role": "user", "content": row["question"]}
    if rng.random() < skip_tool[operation(row["question"])]:
        return [user, {"role": "assistant", "content": in_the_head(row["answer"], rng)}]
    arguments = {"expression": expression(row["question"])}
    call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
    result = calculator(expression(row["question"]))
    return [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


# The GRPO arms of each method: (name, label, how its episodes run).
ARMS = {
    "tools": (("tool", "with the calculator", "tools"), ("no_tool", "without it", None)),
    "agent": (("program", "the openai-client agent", "program"),),
}
# The calculator agent written against the `openai` client as a run's episodes (the agent demo, bench/agent_step.py).
AGENT_OVERRIDE = "rl.agent={program: 'recipes.calculator_agent:run', tool_parser: hermes}"
COLORS = {"tool": "#4477aa", "no_tool": "#aa4444", "program": "#228833"}


def main(
    out: Path, seed: int, grpo_steps: int | None = None, sft_steps: int | None = None, method: str = "tools"
) -> int:
    from rollout.calculator import calculator
    from rollout.tools import tool_schema

    settings = {"method": method, "seed": seed, "grpo_steps": grpo_steps, "sft_steps": sft_steps}
    done = out / f"quickstart_{method}.json"
    if finished(done, settings, report):
        return 0
    start = time.perf_counter()
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    stages = 3 + len(ARMS[method])

    print(f"== 1/{stages} problems (reasoning-gym, offline): 3- and 4-digit sums and differences", flush=True)
    sft_rows, rl_rows = split_problems(4000, 3000)
    rng = random.Random(seed)
    tools = [tool_schema(calculator)]
    chats = [{"messages": sloppy_trace(r, rng, SKIP_TOOL), "tools": tools} for r in sft_rows]
    sft = write_jsonl(data / "sft.jsonl", chats)
    rl = write_jsonl(data / "rl.jsonl", [{k: r[k] for k in ("question", "answer", "metadata")} for r in rl_rows])

    print(f"== 2/{stages} tokenizer (ChatML with tool calls)", flush=True)
    tokenizer = chat_tokenizer(out, chats, tools)
    print(f"== 3/{stages} fine-tuning on the sloppy agent's traces (from a random init)", flush=True)
    fine_tune(out, "tools_sft.yml", sft, tokenizer, seed, sft_steps)
    arms = {}
    for i, (name, label, rollouts) in enumerate(ARMS[method]):
        print(f"== {4 + i}/{stages} GRPO {label}", flush=True)
        arms[name] = grpo_arm(out, name, rollouts, rl, tokenizer, seed, grpo_steps)

    plot = plot_arms(out, out / f"quickstart_{method}.png", method)
    result = {
        "settings": settings,
        "arms": arms,
        "minutes": (time.perf_counter() - start) / 60,
        "plot": str(plot),
    }
    return conclude(done, result, report)


def finished(done: Path, settings: dict, report: Callable[[dict], None]) -> bool:
    """Whether the quickstart whose summary is `done` is complete (its result printed again); one that ran with
    other settings is refused, not overwritten."""
    if not done.exists():
        return False
    summary = json.loads(done.read_text())
    if summary["settings"] != settings:
        from core.errors import UserError

        raise UserError(
            f"{done.parent} holds a {settings['method']} quickstart with other settings ({summary['settings']})"
        )
    print(f"the {settings['method']} quickstart in {done.parent} is complete ({done}); its result:")
    report(summary)
    return True


def conclude(done: Path, result: dict, report: Callable[[dict], None]) -> int:
    """A quickstart's result printed and saved as its summary `done` (what `finished` reads back)."""
    print()
    report(result)
    done.write_text(json.dumps(result, indent=2))
    return 0


def chat_tokenizer(out: Path, chats: list[dict], tools: list) -> str:
    """A byte-level BPE tokenizer (`out/tokenizer`, reused when there) on the conversations as Temper's ChatML
    template renders them (a throwaway tokenizer carries the template), so that the schemas' and the calls' JSON
    become few tokens; `<|im_end|>` its EOS."""
    from transformers import AutoTokenizer

    from core.tokenizer import build_tokenizer, tokenizer_for_run

    template = AutoTokenizer.from_pretrained(build_tokenizer(["0123456789"], out / "data" / "template_only", 300))
    texts = [str(template.apply_chat_template(c["messages"], tools=list(tools), tokenize=False)) for c in chats]
    tokenizer = tokenizer_for_run(None, texts, out, 512)
    end_turns_with_im_end(tokenizer)
    return tokenizer


def fine_tune(out: Path, config: str, data: str, tokenizer: str, seed: int, steps: int | None) -> None:
    """SFT from a random init on the conversations in `data` (`configs/quickstart/<config>`), into `out/sft`."""
    from recipes.sft import main as sft_main

    overrides = [f"run.run_dir={out / 'sft'}", f"data.source={data}", f"data.tokenizer_dir={tokenizer}"]
    overrides += [f"run.seed={1 + seed}", *([f"train.steps={steps}"] if steps else [])]
    _check(sft_main([str(CONFIGS / config), *overrides]))


def grpo_arm(out: Path, name: str, rollouts: str | None, rl: str, tokenizer: str, seed: int, steps: int | None) -> dict:
    """One GRPO arm from the fine-tuned model, its episodes the built-in `tools` environment's, the calculator
    agent's (`program`) or single turns (None): its held-out accuracy before and after (kept for a resumed arm)."""
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from posttrain.config import PostTrainConfig
    from posttrain.fit import fit
    from posttrain.grpo import GRPO

    stage = out / name
    overrides = [
        f"run.run_dir={stage}",
        f"data.source={rl}",
        f"data.tokenizer_dir={tokenizer}",
        f"checkpoint.init_from={out / 'sft' / 'hf'}",
        f"run.seed={2 + seed}",
        *([f"train.steps={steps}"] if steps else []),
        "train.eval_on_start=true",
    ]
    if rollouts is None:
        overrides.append("rl.agent=null")
    elif rollouts == "program":  # the agent runs its own turns (up to 3) and the calculator
        overrides.append(AGENT_OVERRIDE)
    cfg = load_config(CONFIGS / "tools_grpo.yml", overrides, schema=PostTrainConfig)
    if cfg.train.steps % cfg.train.eval_every:  # an evaluation on the last step, whatever the step count
        cfg = load_config(CONFIGS / "tools_grpo.yml", [*overrides, f"train.eval_every={cfg.train.steps}"],
                          schema=PostTrainConfig)  # fmt: skip
    summary = fit(cfg, GRPO)  # evaluated at step 0 (the fine-tuned model) and every eval_every steps to the last
    evals = {r["step"]: r["eval/pass@1"] for r in read_metrics(stage) if "eval/pass@1" in r}  # a resumed arm's too
    return {"before": evals[0], "after": evals[summary.steps], "steps": summary.steps}


def plot_arms(out: Path, path: Path, method: str = "tools") -> str:
    """The arms' held-out greedy accuracy (evaluations, step 0 = after SFT) and training accuracy over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.metrics import read_metrics

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label, _ in ARMS[method]:
        rows, color = read_metrics(out / name), COLORS[name]
        evals = [(r["step"], 100 * r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
        train = [(r["step"], 100 * r["accuracy"]) for r in rows if "accuracy" in r]
        if evals:
            ax.plot(*zip(*evals), marker="o", color=color, label=f"GRPO {label}: held-out greedy")
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.4, label=f"GRPO {label}: sampled (training)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("3- and 4-digit arithmetic, a tiny model, and a calculator")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path.absolute())


def report(summary: dict) -> None:
    arms = summary["arms"]
    print("held-out greedy accuracy after SFT on the sloppy agent's traces, then after GRPO:")
    for name, label, _ in ARMS[summary["settings"]["method"]]:
        a = arms[name]
        print(f"  GRPO {label:<20} {a['before']:.1%} -> {a['after']:.1%} ({a['steps']} steps)")
    print(f"total {summary['minutes']:.1f} min; curves: {summary['plot']}")
