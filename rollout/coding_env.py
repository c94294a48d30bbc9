"""A coding environment: fix a small Python function so that its tests pass, in a sandbox (`rollout/sandbox.py`).

    rows = coding_tasks(200, seed=0)        # offline: a buggy solution.py, its test_solution.py, an instruction
    agent:
      environment: coding
      environment_kwargs: {wall_s: 10}

Each task is a one-line function with a planted bug (an operator, a constant, a comparison) and a test file of
asserts computed from the right function. The model is offered three tools: `read_file(path)`, `write_file(path,
content)` and `run_tests()`, which runs the tests in a sandbox holding the episode's files and returns the exit code
and output. A turn without a call is the model's answer: the **verifier** copies the episode's files into a fresh
sandbox with the task's own test file (an agent that edits the tests gains nothing), runs it, and the episode's
reward is 1.0 if it passes, else 0.0.

The episode's state is its files (a dict of path -> text), not a directory: each `run_tests` and the verifier build a
sandbox from them and remove it after, so any worker can take any step, nothing is left behind when an episode ends
early, and a checkpoint or a pickled state carries everything. Paths are relative to the sandbox: an absolute path or
one that leaves it is answered with an error the model reads.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

from rollout.environment import Environment, EnvReply, EnvStart
from rollout.sandbox import Limits, LocalRuntime, relative_path
from rollout.tool_parsing import ParsedTurn
from rollout.tools import ToolReply, call_tool, tool_messages, tool_schema

SOLUTION, TESTS = "solution.py", "test_solution.py"

# (function name, right body, buggy body, the inputs the tests try); K is a per-task constant.
BUGS = [
    ("add_k", "x + K", "x - K", range(-3, 4)),
    ("scale", "x * K", "x + K", range(-3, 4)),
    ("is_multiple", "x % K == 0", "x % K == 1", range(0, 12)),
    ("at_least", "x >= K", "x > K", range(0, 12)),
    ("clamp_low", "max(x, K)", "min(x, K)", range(-5, 15)),
    ("last_digit_is", "x % 10 == K % 10", "x % 10 == K", range(0, 40)),
]


def coding_tasks(n: int, seed: int = 0) -> list[dict]:
    """`n` tasks, the same for a seed: a row each, its `prompt` (the instruction) and `files`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        name, right, wrong, inputs = BUGS[i % len(BUGS)]
        k = rng.randint(2, 9)
        solution = f"def {name}(x):\n    return {wrong.replace('K', str(k))}\n"
        cases = [(x, eval(right.replace("K", str(k)), {}, {"x": x})) for x in inputs]  # the right answers
        tests = f"from solution import {name}\n\n" + "".join(f"assert {name}({x!r}) == {y!r}\n" for x, y in cases)
        tests += 'print("all tests passed")\n'
        prompt = (
            f"The function `{name}` in {SOLUTION} fails its tests in {TESTS}. Fix {SOLUTION} so that the tests pass. "
            "Use the tools to read the files, write the fix and run the tests; answer when they pass."
        )
        rows.append({"prompt": prompt, "files": {SOLUTION: solution, TESTS: tests}, "task": f"{name}-{k}"})
    return rows


def read_file(path: str) -> str:
    """Read a file of the task.

    Args:
        path: The file's path, relative to the task's directory (e.g. "solution.py").
    """
    raise NotImplementedError  # a schema only: the environment answers the call


def write_file(path: str, content: str) -> str:
    """Write a file of the task, replacing it.

    Args:
        path: The file's path, relative to the task's directory.
        content: The file's whole new text.
    """
    raise NotImplementedError


def run_tests() -> str:
    """Run the task's tests and return their exit code and output."""
    raise NotImplementedError


SCHEMAS = {fn.__name__: tool_schema(fn) for fn in (read_file, write_file, run_tests)}


class CodingEnvironment(Environment):
    def __init__(self, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, output_bytes: int = 4000):
        self.runtime = LocalRuntime()  # refused here, at start, where the machine cannot confine
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, output_bytes=output_bytes)

    def reset(self, row: dict) -> EnvStart:
        files = dict(row["files"])
        message = f"{row['prompt']}\n\nFiles: {', '.join(sorted(files))}."
        state = {"files": files, "tests": {TESTS: files[TESTS]}}
        return EnvStart([{"role": "user", "content": message}], list(SCHEMAS.values()), state=state)

    def _run(self, files: dict[str, str]) -> tuple[int, str]:
        box = self.runtime.create(files)
        try:
            result = box.run([sys.executable, TESTS], self.limits)
        finally:
            box.close()
        if result.timed_out:
            return 1, f"the tests did not finish within {self.limits.wall_s:g} s"
        return result.returncode, (result.stdout + result.stderr)[-self.limits.output_bytes :]

    def step(self, state: Any, turn: ParsedTurn) -> EnvReply:
        files = dict(state["files"])
        if turn.malformed is not None:
            message = {"role": "tool", "content": f"Error: your tool call could not be read: {turn.malformed}."}
            return EnvReply([message], state=state, tool_calls=1, tool_errors=1)
        if not turn.tool_calls:  # the answer: the task's own tests, in a fresh sandbox of the episode's files
            code, _ = self._run({**files, **state["tests"]})
            return EnvReply(done=True, reward=1.0 if code == 0 else 0.0, state=state)

        def read(path: str) -> str:
            name = relative_path(path)
            if name not in files:
                raise FileNotFoundError(f"no file {path!r} (files: {', '.join(sorted(files))})")
            return files[name]

        def write(path: str, content: str) -> str:
            files[relative_path(path)] = content
            return f"wrote {len(content)} characters to {path}"

        def run() -> str:
            code, output = self._run(files)
            return f"exit code {code}\n{output}"

        tools: dict[str, Callable[..., str]] = {"read_file": read, "write_file": write, "run_tests": run}
        replies: list[ToolReply] = [
            call_tool(tools.get(c.name), SCHEMAS.get(c.name), c, self.limits.wall_s + 5) for c in turn.tool_calls
        ]
        errors = sum(r.error is not None for r in replies)
        new = {"files": files, "tests": state["tests"]}
        return EnvReply(tool_messages(turn.tool_calls, replies), state=new, tool_calls=len(replies), tool_errors=errors)
