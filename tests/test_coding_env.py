"""The coding environment (`rollout/coding_env.py`): tasks generated offline whose planted bug fails their tests;
the tools read, write and run in a sandbox built from the episode's files; the verifier runs the hidden tests on a
fresh copy and rewards only a real fix (not rewritten tests, an early exit, an always-equal object or a table of
the visible answers); paths outside are refused as errors the model reads."""

from __future__ import annotations

import json

import pytest

from rewards.pool import WorkerPool
from rollout.coding_env import SOLUTION, TESTS, coding_tasks
from rollout.environment import EnvironmentRunner
from rollout.sandbox import namespaces_work
from rollout.tool_parsing import ParsedTurn
from rollout.tools import ToolCall

pytestmark = pytest.mark.skipif(namespaces_work() is not None, reason=f"no sandbox here: {namespaces_work()}")


def _calls(*calls: tuple[str, dict]) -> ParsedTurn:
    return ParsedTurn("", "", [ToolCall(name, json.dumps(args)) for name, args in calls])


def test_tasks_fail_as_given_and_the_verifier_rewards_only_a_real_fix():
    rows = coding_tasks(6, seed=0)
    assert len({r["task"] for r in rows}) == 6 and coding_tasks(6, seed=0) == rows  # offline, the same for a seed
    pool = WorkerPool(2)  # the state (the episode's files) travels between the workers
    try:
        env = EnvironmentRunner("coding", {}, pool, timeout_s=60.0)
        env.check()
        row = rows[0]  # add_k: `x - K` where `x + K` is right
        k = row["task"].split("-")[1]
        starts = env.reset([row, row, row])
        assert [t["function"]["name"] for t in starts[0].tools] == ["read_file", "write_file", "run_tests"]
        states = [s.state for s in starts]
        fixed = f"def add_k(x):\n    return x + {k}\n"
        cheat = 'print("all tests passed")\n'
        turns = [
            _calls(("run_tests", {}), ("read_file", {"path": SOLUTION})),
            _calls(("write_file", {"path": TESTS, "content": cheat}), ("run_tests", {})),  # rewrites the tests
            _calls(("write_file", {"path": "../escape.py", "content": "x"}), ("read_file", {"path": "/etc/passwd"})),
        ]
        replies = env.step(states, turns)
        first = [m["content"] for m in replies[0].messages]
        assert first[0].startswith("exit code 1") and "AssertionError" in first[0] and "x - " in first[1]
        assert [m["content"] for m in replies[1].messages][1].startswith("exit code 0")  # its own tests pass...
        assert all("outside the sandbox" in m["content"] for m in replies[2].messages)
        assert replies[2].tool_errors == 2
        states = [r.state for r in replies]
        fix = _calls(("write_file", {"path": SOLUTION, "content": fixed}), ("run_tests", {}))
        replies = env.step([states[0]], [fix])
        assert replies[0].messages[1]["content"].startswith("exit code 0")
        answer = ParsedTurn("Fixed.", "Fixed.")
        # ways to pass the visible tests without the fix: each scores 0 with the verifier
        visible = {x: x + int(k) for x in range(-3, 4)}
        cheats = {
            "exits": "import sys\nsys.exit(0)\n",
            "equal_to_all": (
                "class Yes:\n    def __eq__(self, o):\n        return True\n\ndef add_k(x):\n    return Yes()\n"
            ),
            "table": f"def add_k(x):\n    return {visible!r}.get(x, 0)\n",
        }
        cheat_states = []
        for text in cheats.values():
            (r,) = env.step(
                [states[0]], [_calls(("write_file", {"path": SOLUTION, "content": text}), ("run_tests", {}))]
            )
            cheat_states.append(r.state)
        assert "exit code 0" in r.messages[1]["content"]  # the table passes the visible tests
        finals = [replies[0].state, states[1], states[2], *cheat_states]
        ends = env.step(finals, [answer] * len(finals))
        assert [e.done for e in ends] == [True] * len(finals)
        # the fix passes; rewritten tests, an early exit, an always-equal object and a table of answers do not
        assert [e.reward for e in ends] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    finally:
        pool.close()


def test_every_kind_of_task_fails_as_given_and_passes_with_its_right_body():
    """The verifier on each of the six kinds of task: 0 on the files as given (a planted bug that changes nothing
    would be a free reward: `last_digit_is` had one, found by a GRPO run's reward), 1 with the right body."""
    from rollout.coding_env import BUGS, CodingEnvironment

    env = CodingEnvironment()
    for row, (name, right, _, _) in zip(coding_tasks(len(BUGS), seed=0), BUGS, strict=True):
        k = row["task"].split("-")[1]
        assert env.verify(row["files"], row["hidden"]) == 0.0, row["task"]
        fixed = {**row["files"], SOLUTION: f"def {name}(x):\n    return {right.replace('K', k)}\n"}
        assert env.verify(fixed, row["hidden"]) == 1.0, row["task"]
