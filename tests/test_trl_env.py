"""Environment classes written for TRL's `environment_factory`, used unchanged (`rollout/trl_env.py`): their public
methods are the tools, `reset(**row)`'s observation joins the prompt, `get_reward()` is the episode's reward; the
instance travels between the worker pool's processes; on the JAX sampler a scripted model's calls run on it."""

from __future__ import annotations

import json

import pytest

from rewards.pool import WorkerPool
from rollout.environment import EnvFailure, EnvironmentRunner, EnvReply, EnvStart
from rollout.tool_parsing import ParsedTurn
from rollout.tools import ToolCall


def _call(name: str, **arguments) -> ParsedTurn:
    return ParsedTurn("", "", [ToolCall(name, json.dumps(arguments))])


def test_a_trl_class_runs_unchanged_in_the_worker_pool():
    pool = WorkerPool(2)  # the instance is pickled into and out of whichever worker takes each call
    try:
        env = EnvironmentRunner("tests.trl_envs:Counter", {}, pool, timeout_s=30.0)
        env.check()
        assert env.spec == "rollout.trl_env:TRLEnvironment"  # through the adapter
        (start,) = env.reset([{"prompt": "Count.", "target": 10}])
        assert isinstance(start, EnvStart) and start.messages == [{"role": "user", "content": "Count. Reach 10."}]
        (schema,) = start.tools
        assert schema["function"]["name"] == "increment"
        assert schema["function"]["parameters"]["properties"]["step"]["type"] == "integer"
        state = start.state
        replies = []
        for turn in [
            _call("increment", step=4),
            _call("increment", step="six"),
            _call("nope"),
            _call("increment", step=6),
        ]:
            (reply,) = env.step([state], [turn])
            assert isinstance(reply, EnvReply) and not reply.done
            replies.append(reply.messages[0]["content"])
            state = reply.state
        assert replies[0] == "4" and replies[3] == "10"  # the state went on across calls and processes
        assert "bad call to increment" in replies[1] and "no tool named 'nope'" in replies[2]
        (end,) = env.step([state], [ParsedTurn("Done.", "Done.")])
        assert end.done and end.reward == 1.0  # get_reward() when the model answers
        failed = EnvironmentRunner("tests.trl_envs:Unpicklable", {}, pool, timeout_s=30.0)
        (bad,) = failed.reset([{"prompt": "Read."}])
        assert isinstance(bad, EnvFailure) and "instances must pickle" in bad.message
    finally:
        pool.close()


@pytest.mark.integration
def test_a_scripted_model_calls_a_trl_class_s_tool_on_the_jax_sampler(tmp_path):
    """The calculator as a TRL-style class (`tests.trl_envs:Calculator`) on a real sampler: a scripted model calls
    it every turn (Qwen2.5's template, Hermes calls); each call runs on the episode's instance and its result comes
    back as a `tool` message between the turns, untrained."""
    from tests.test_agent_run import calculator_episodes

    episodes, _ = calculator_episodes(tmp_path, "tests.trl_envs:Calculator")
    assert [e.state.instance.calls for e in episodes] == [
        3,
        3,
    ]  # the instance each episode ended with ran its three calls


def test_trl_classes_are_told_from_temper_environments_by_how_reset_takes_the_row():
    from rollout.tool_env import ToolEnvironment
    from rollout.trl_env import is_trl_environment
    from tests.trl_envs import Calculator, Counter, Walker

    assert is_trl_environment(Counter) and is_trl_environment(Calculator)
    assert is_trl_environment(Walker)  # a tool named step does not make it a Temper environment
    assert not is_trl_environment(ToolEnvironment) and not is_trl_environment(len)


def test_a_mapping_of_trl_classes_routes_each_row_by_its_environment_column():
    """TRL's multi-environment form: each row's `environment` names its class; only that class's tools are offered,
    its `reset` gets the row without the routing field, and a row naming no known class fails its episode, named.
    The metrics split by environment."""
    from posttrain.onpolicy.agent import episode_metrics
    from rollout.episodes import Episode

    pool = WorkerPool(1)
    try:
        spec = {"counter": "tests.trl_envs:Counter", "calculator": "tests.trl_envs:Calculator"}
        env = EnvironmentRunner(spec, {}, pool, timeout_s=30.0)
        env.check()
        rows = [
            {"prompt": "Count.", "environment": "counter", "target": 3},
            {"prompt": "Add.", "environment": "calculator"},
            {"prompt": "?", "environment": "chess"},
        ]
        counter, calculator, unknown = env.reset(rows)
        assert [t["function"]["name"] for t in counter.tools] == ["increment"]
        assert [t["function"]["name"] for t in calculator.tools] == ["calculator"]
        assert counter.messages[0]["content"] == "Count. Reach 3."
        assert isinstance(unknown, EnvFailure) and "'chess', not one of counter, calculator" in unknown.message
        a, b = env.step(
            [counter.state, calculator.state], [_call("increment", step=3), _call("calculator", expression="2 + 3")]
        )
        assert a.messages[0]["content"] == "3" and b.messages[0]["content"] == "5"
        (wrong,) = env.step([calculator.state], [_call("increment", step=1)])  # the other class's tool
        assert "no tool named 'increment'" in wrong.messages[0]["content"]
        (end,) = env.step([a.state], [ParsedTurn("Done.", "Done.")])
        assert end.done and end.reward == 1.0
    finally:
        pool.close()
    episodes = [Episode(r, turns=t, finish=f) for r, t, f in zip(rows, (2, 1, 0), ("done", "done", "failed"))]
    m = episode_metrics(episodes)
    assert (m["agent/counter/turns"], m["agent/calculator/turns"], m["agent/chess/failed"]) == (2.0, 1.0, 1.0)
