"""The `make demo` job runs end to end and reports parity."""

import pytest

from recipes.hf_parity_demo import main


@pytest.mark.integration
def test_demo_runs_and_reports_parity(tmp_path, capsys):
    assert main([f"run.run_dir={tmp_path}", "mesh.debug_sharding=true"]) == 0
    out = capsys.readouterr().out
    assert "OK: max |diff|" in out and "total: " in out
    assert (tmp_path / "config.yaml").exists()
    assert (tmp_path / "qwen3-tied1" / "export" / "model.safetensors").exists()


def test_demo_rejects_unknown_key(tmp_path):
    from core.config_loader import ConfigError

    with pytest.raises(ConfigError, match="mesh.fsdpp"):
        main([f"run.run_dir={tmp_path}", "mesh.fsdpp=2"])


@pytest.mark.integration
@pytest.mark.serial
def test_quickstart_runs_every_stage(tmp_path):
    """`make demo` in miniature: every stage runs and the run directory holds what the docs promise; run again
    on the same directory, it says that it is complete and prints the same result, with no warnings."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "qs"
    cmd = [
        sys.executable,
        "-m",
        "recipes.quickstart",
        "--run-dir",
        str(out),
        "--pretrain-steps",
        "10",
        "--sft-steps",
        "6",
        "--grpo-steps",
        "2",
        "--eval-prompts",
        "8",
    ]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "held-out greedy accuracy:" in done.stdout and "after 2 GRPO steps" in done.stdout
    for path in (
        "pretrain/hf/config.json",
        "sft/hf/config.json",
        "grpo/hf/config.json",
        "grpo/metrics.jsonl",
        "quickstart.png",
        "grpo/reward.png",
        "data/rl.jsonl",
        "tokenizer/tokenizer.json",
        "quickstart.json",
    ):
        assert (out / path).exists(), path
    noise = ("could not be restored", "os.fork() was called", "Traceback")
    assert not [line for line in (done.stdout + done.stderr).splitlines() if any(n in line for n in noise)]
    result = done.stdout[done.stdout.index("held-out greedy accuracy:") :].splitlines()[:2]
    again = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"the quickstart in {out} is complete" in again.stdout
    assert again.stdout.splitlines()[1:3] == result  # the same accuracy lines
    assert not [line for line in (again.stdout + again.stderr).splitlines() if any(n in line for n in noise)]
    other = subprocess.run([*cmd, "--seed", "1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "holds a quickstart run with other settings" in other.stderr


def test_quickstart_sloppy_solver_only_drops_signs():
    from recipes.quickstart import main as quickstart
    from recipes.quickstart import sloppy_answers

    rows = [{"answer": a} for a in ["-4", "7", "-12", "0", "-79"] * 200]
    assert sloppy_answers(rows, 0.0) == [r["answer"] for r in rows]
    assert sloppy_answers(rows, 1.0) == [r["answer"].lstrip("-") for r in rows]
    slipped = sloppy_answers(rows, 0.8)
    assert all(s == r["answer"] for s, r in zip(slipped, rows) if not r["answer"].startswith("-"))
    dropped = sum(s != r["answer"] for s, r in zip(slipped, rows)) / 600
    assert 0.75 < dropped < 0.85 and slipped == sloppy_answers(rows, 0.8)  # seeded
    with pytest.raises(SystemExit):
        quickstart(["--sign-slip", "1.5"])


def test_the_tools_quickstarts_sloppy_agent_calls_the_calculator_or_misses_by_a_digit():
    """`make demo-tools`' SFT traces: a quarter of the sums and 90% of the differences call the calculator with the
    problem's expression, read its result and answer with it (right); the rest answer in the head, wrong in exactly
    one digit; the problems are (nearly all) beyond the tiny model's head (3- and 4-digit operands)."""
    import random

    from recipes.quickstart import parse
    from recipes.quickstart_tools import SKIP_TOOL, expression, operation, sloppy_trace, split_problems, tool_problems

    with pytest.raises(SystemExit):  # flags of the other quickstarts are refused, not ignored
        parse(["--method", "tools", "--pretrain-steps", "5"])
    assert parse(["--method", "tools", "--sft-steps", "5"]).run_dir == "runs/quickstart_tools"
    sft, rl = split_problems(400, 300)  # the held-out problems were once all in SFT's data (nearby seeds)
    assert len(rl) > 290 and not {r["question"] for r in sft} & {r["question"] for r in rl}

    rows = tool_problems(400, seed=5)
    widest = [max(len(n) for n in expression(r["question"]).replace(" - ", " + ").split(" + ")) for r in rows]
    assert sum(w >= 3 for w in widest) >= 0.99 * len(rows)  # reasoning-gym's digit counts are loose: a few 2-digit
    rng = random.Random(0)
    traces = [sloppy_trace(r, rng, SKIP_TOOL) for r in rows]
    for op, share in (("+", 0.25), ("-", 0.9)):  # the agent trusts its head with sums
        of_op = [t for r, t in zip(rows, traces) if operation(r["question"]) == op]
        assert len(of_op) > 150 and abs(sum(len(t) == 4 for t in of_op) / len(of_op) - share) < 0.08
    for row, trace in zip(rows, traces):
        answer = trace[-1]["content"]
        if len(trace) == 4:
            call = trace[1]["tool_calls"][0]["function"]
            assert call == {"name": "calculator", "arguments": {"expression": expression(row["question"])}}
            assert trace[2] == {"role": "tool", "content": row["answer"]} and answer == row["answer"]
        else:
            assert len(trace) == 2 and len(answer) == len(row["answer"])
            assert sum(a != b for a, b in zip(answer, row["answer"])) == 1


def test_the_coding_quickstarts_sloppy_coder_writes_the_fix_or_the_file_unchanged():
    """`make demo-agent`'s coding stage: the sloppy coder's conversations start from the message the coding
    environment starts its episodes with (so the fine-tuned model sees in GRPO what it was tuned on), call the
    environment's own tools, and write the fix (which the verifier passes) about 30% of the time, else the file as
    it was (which it fails). `--method agent` and `--method coding` have their own run directories."""
    import random

    from recipes.quickstart import parse
    from recipes.quickstart_coding import RIGHT_SHARE, fixed_source, sloppy_fix
    from rollout.coding_env import SCHEMAS, SOLUTION, CodingEnvironment, coding_tasks

    assert parse(["--method", "agent"]).run_dir == "runs/quickstart_agent"
    assert parse(["--method", "coding"]).run_dir == "runs/quickstart_coding"
    env = CodingEnvironment()
    rows = coding_tasks(300, seed=1)
    rng = random.Random(0)
    fixed = 0
    for row in rows:
        chat = sloppy_fix(row, rng)
        assert chat[0] == env.reset(row).messages[0]
        calls = [m["tool_calls"][0]["function"] for m in chat if m.get("tool_calls")]
        assert [c["name"] for c in calls] == ["read_file", "write_file"] and set(SCHEMAS) >= {"read_file", "write_file"}
        written = calls[1]["arguments"]["content"]
        assert written in (fixed_source(row), row["files"][SOLUTION])
        fixed += written == fixed_source(row)
    assert abs(fixed / len(rows) - RIGHT_SHARE) < 0.08
    for row in rows[:6]:  # one task of each kind: the fix passes the hidden tests, the file as given does not
        assert env.verify({**row["files"], SOLUTION: fixed_source(row)}, row["hidden"]) == 1.0, row["task"]
        assert env.verify(row["files"], row["hidden"]) == 0.0, row["task"]


def test_the_agent_quickstarts_calculator_agent_offers_the_tools_demos_schema():
    """The agent written against the client offers the schema the built-in `tools` environment renders (the
    fine-tuning traces' own), so both paths give the model the same prompt tokens."""
    from recipes.calculator_agent import TOOLS
    from rollout.calculator import calculator
    from rollout.tool_env import ToolEnvironment

    assert ToolEnvironment(tools=["calculator"]).reset({"prompt": "1 + 1"}).tools == TOOLS
    assert TOOLS[0]["function"]["name"] == calculator.__name__
