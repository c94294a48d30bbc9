"""A coding environment: fix a small Python function so that its tests pass, in a sandbox (`rollout/sandbox.py`).

    rows = coding_tasks(200, seed=0)        # offline: a buggy solution.py, its test_solution.py, an instruction
    agent:
      environment: coding
      environment_kwargs: {wall_s: 10}

Each task is a one-line function with a planted bug (an operator, a constant, a comparison) and a visible test file
of asserts computed from the right function. The model is offered three tools: `read_file(path)`, `write_file(path,
content)` and `run_tests()`, which runs the visible tests in a sandbox holding the episode's files and returns the
exit code and output. A turn without a call is the model's answer: the **verifier** runs the task's hidden tests (the
visible inputs and a wider range, each value's type checked as well as its value, ending by printing a nonce drawn
then) in a fresh sandbox of the episode's files; the reward is 1.0 if they pass and print the nonce, else 0.0. A
rewritten test file, a solution that exits 0 on import, an object whose `==` says yes to everything or a table of
the visible answers all score 0.

The episode's state is its files (a dict of path -> text), not a directory: each `run_tests` and the verifier build a
sandbox from them and remove it after, so any worker can take any step, nothing is left behind when an episode ends
early, and a checkpoint or a pickled state carries everything. Paths are relative to the sandbox: an absolute path or
one that leaves it is answered with an error the model reads.
"""

from __future__ import annotations

import random
import secrets
import sys
from collections.abc import Callable
from typing import Any

from rollout.environment import Environment, EnvReply, EnvStart
from rollout.sandbox import Limits, LocalRuntime, relative_path
from rollout.tool_env import tool_calls_reply
from rollout.tool_parsing import ParsedTurn
from rollout.tools import tool_schema

SOLUTION, TESTS = "solution.py", "test_solution.py"

# (function name, right body, buggy body, the inputs the visible tests try); K is a per-task constant. The hidden
# tests, the verifier's, try inputs from a wider range.
BUGS = [
    ("add_k", "x + K", "x - K", range(-3, 4)),
    ("scale", "x * K", "x + K", range(-3, 4)),
    ("is_multiple", "x % K == 0", "x % K == 1", range(0, 12)),
    ("at_least", "x >= K", "x > K", range(0, 12)),
    ("clamp_low", "max(x, K)", "min(x, K)", range(-5, 15)),
    ("last_digit_is", "x % 10 == K", "x // 10 == K", range(0, 40)),
]
HIDDEN = range(-60, 61, 7)


def _asserts(name: str, right: str, k: int, inputs) -> str:
    """Asserts of `name`'s value and its exact type (an object whose == says yes to everything fails)."""
    lines = []
    for x in inputs:
        y = eval(right.replace("K", str(k)), {}, {"x": x})  # the right answer (a constant expression)
        lines.append(f"r = {name}({x!r})\nassert type(r) is {type(y).__name__} and r == {y!r}, ({x!r}, r)\n")
    return "".join(lines)


def coding_tasks(n: int, seed: int = 0) -> list[dict]:
    """`n` tasks, the same for a seed: a row each, its `prompt` (the instruction), the `files` the model sees and
    the `hidden` tests the verifier runs."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        name, right, wrong, inputs = BUGS[i % len(BUGS)]
        k = rng.randint(2, 9)
        solution = f"def {name}(x):\n    return {wrong.replace('K', str(k))}\n"
        head = f"from solution import {name}\n\n"
        tests = head + _asserts(name, right, k, inputs) + 'print("all tests passed")\n'
        prompt = (
            f"The function `{name}` in {SOLUTION} fails its tests in {TESTS}. Fix {SOLUTION} so that the tests pass. "
            "Use the tools to read the files, write the fix and run the tests; answer when they pass."
        )
        hidden = head + _asserts(name, right, k, [*inputs, *HIDDEN])
        rows.append(
            {"prompt": prompt, "files": {SOLUTION: solution, TESTS: tests}, "hidden": hidden, "task": f"{name}-{k}"}
        )
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
        state = {"files": files, "hidden": row["hidden"]}
        return EnvStart([{"role": "user", "content": message}], list(SCHEMAS.values()), state=state)

    def verify(self, files: dict[str, str], hidden: str) -> float:
        """1.0 if the hidden tests pass on a fresh sandbox of the episode's files, else 0.0. They end by printing a
        nonce drawn now: a solution that exits early with status 0 (or rewrites the tests) does not print it."""
        nonce = secrets.token_hex(16)
        name = f"verify_{nonce[:8]}.py"
        code, output = self._run({**files, name: hidden + f"print({nonce!r})\n"}, name)
        return 1.0 if code == 0 and nonce in output else 0.0

    def _run(self, files: dict[str, str], tests: str = TESTS) -> tuple[int, str]:
        box = self.runtime.create(files)
        try:
            result = box.run([sys.executable, tests], self.limits)
        finally:
            box.close()
        if result.timed_out:
            return 1, f"the tests did not finish within {self.limits.wall_s:g} s"
        return result.returncode, (result.stdout + result.stderr)[-self.limits.output_bytes :]

    def step(self, state: Any, turn: ParsedTurn) -> EnvReply:
        files = dict(state["files"])  # the tools write into this copy: the next state's

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
        new = {"files": files, "hidden": state["hidden"]}
        reply = tool_calls_reply(turn, tools, SCHEMAS, self.limits.wall_s + 5, new)
        if reply is not None:
            return reply
        return EnvReply(done=True, reward=self.verify(files, state["hidden"]), state=state)  # the answer: the verifier
