"""Environment classes written for TRL's `environment_factory`, used unchanged (`rollout/trl_env.py`): their public
methods are the tools, `reset(**row)`'s observation joins the prompt, `get_reward()` is the episode's reward; the
instance stays in the worker that built it (the pool runs its episode's steps there); a mapping routes each row to
its environment (TRL-style or Temper's); GRPO trains over one on vLLM."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rewards.pool import WorkerPool
from rollout.environment import EnvFailure, EnvironmentRunner, EnvReply, EnvStart
from rollout.tool_parsing import ParsedTurn
from rollout.tools import ToolCall


def _call(name: str, **arguments) -> ParsedTurn:
    return ParsedTurn("", "", [ToolCall(name, json.dumps(arguments))])


def test_a_trl_class_runs_unchanged_in_the_worker_pool():
    pool = WorkerPool(2)  # the instance stays in the worker that built it; every step goes there
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
    finally:
        pool.close()


def test_a_class_whose_tool_and_reward_are_coroutines_runs_them_on_its_workers_loop():
    """`AsyncCounter`: its `increment` and `get_reward` are coroutines (TRL allows both). Each call runs on the worker's
    one event loop (the class fails a call on another loop than its first, as a client bound to its loop would), a call
    that hangs is stopped at `tool_timeout_s` and answered with an error, and the coroutine reward is the episode's.
    A coroutine `reset` is refused (TRL calls it synchronously)."""
    from rollout.trl_env import TRLEnvironment

    pool = WorkerPool(1)
    try:
        env = EnvironmentRunner("tests.trl_envs:AsyncCounter", {"tool_timeout_s": 1.0}, pool, timeout_s=30.0)
        env.check()
        (start,) = env.reset([{"prompt": "Count."}])
        assert [t["function"]["name"] for t in start.tools] == ["increment"]
        state, seen = start.state, []
        for turn in [_call("increment", step=4), _call("increment", step=3), _call("increment", step=-1)]:
            (reply,) = env.step([state], [turn])
            assert isinstance(reply, EnvReply) and not reply.done, reply
            seen.append(reply.messages[0]["content"])
            state = reply.state
        assert seen[:2] == ["4", "7"] and "did not finish within 1 s" in seen[2], seen
        (end,) = env.step([state], [ParsedTurn("Done.", "Done.")])
        assert end.done and end.reward == 6.0  # 4 + 3 - 1: the stopped call had added its step before it hung
    finally:
        pool.close()

    class AsyncReset:
        async def reset(self, **kwargs) -> None:
            return None

    import tests.trl_envs

    tests.trl_envs.AsyncReset = AsyncReset  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="reset is a coroutine; TRL calls it synchronously"):
        TRLEnvironment("tests.trl_envs:AsyncReset")


def test_instances_that_do_not_pickle_stay_in_the_worker_that_built_them():
    """An instance holding an open file is kept by the worker that ran its reset, and every step of its episode goes
    there (each read goes on from where the last one stopped). When that worker is replaced the instance is gone:
    the episode's next step fails as the environment's failure, not the model's (`infrastructure`: it restarts);
    the episodes on the other worker go on. The adapter drops an instance when its episode ends or is released."""
    import tests.trl_envs
    from rollout.environment import Pinned
    from rollout.trl_env import TRLEnvironment

    lines = [line.strip() for line in open(tests.trl_envs.__file__)]  # noqa: SIM115
    pool = WorkerPool(2)
    try:
        env = EnvironmentRunner("tests.trl_envs:Unpicklable", {}, pool, timeout_s=30.0)
        starts = env.reset([{"prompt": "Read."}] * 6)
        states = [s.state for s in starts]
        assert all(isinstance(s, Pinned) for s in states), starts
        workers = [s.worker for s in states]
        assert set(workers) == {0, 1}  # both workers keep some
        for k in range(3):
            replies = env.step(states, [_call("read")] * 6)
            assert [r.messages[0]["content"].strip() for r in replies] == [lines[k]] * 6, replies
            states = [r.state for r in replies]
            assert [s.worker for s in states] == workers
        victim = workers[0]
        pool._workers[victim].kill()
        replies = env.step(states, [_call("read")] * 6)
        for worker, reply in zip(workers, replies, strict=True):
            if worker == victim:
                assert isinstance(reply, EnvFailure) and reply.infrastructure, reply
                assert reply.state_lost, reply  # the new worker has no such instance
            else:
                assert reply.messages[0]["content"].strip() == lines[3]
    finally:
        pool.close()
    local = TRLEnvironment("tests.trl_envs:Unpicklable")
    done, cut = local.reset({"prompt": "Read."}), local.reset({"prompt": "Read."})
    assert done.pinned and len(local.kept) == 2
    assert local.step(done.state, ParsedTurn("Done.", "Done.")).done and len(local.kept) == 1
    local.release(cut.state)
    assert local.kept == {}


def test_trl_classes_are_told_from_temper_environments_by_how_reset_takes_the_row():
    from rollout.tool_env import ToolEnvironment
    from rollout.trl_env import is_trl_environment
    from tests.trl_envs import Calculator, Counter, Walker

    assert is_trl_environment(Counter) and is_trl_environment(Calculator)
    assert is_trl_environment(Walker)  # a tool named step does not make it a Temper environment
    assert not is_trl_environment(ToolEnvironment) and not is_trl_environment(len)


def test_a_mapping_routes_each_row_to_its_environment_by_its_column():
    """TRL's multi-environment form, for any environment: each row's `environment` names its own (two TRL-style
    classes and the built-in coding environment with its own kwargs); only that environment's tools are offered,
    its `reset` gets the row without the routing field, each step goes to it with its own state, and a row naming
    no known environment fails its episode, named. The metrics split by environment. Kwargs under a name the
    mapping does not have are refused when the environment is built (at start)."""
    from posttrain.onpolicy.agent import environment_of, episode_metrics
    from posttrain.rl_config import AgentConfig
    from rollout.coding_env import coding_tasks
    from rollout.episodes import Episode

    pool = WorkerPool(1)
    try:
        spec = {"counter": "tests.trl_envs:Counter", "calculator": "tests.trl_envs:Calculator", "coding": "coding"}
        env = EnvironmentRunner(spec, {"coding": {"wall_s": 7}}, pool, timeout_s=30.0)
        env.check()
        rows = [
            {"prompt": "Count.", "environment": "counter", "target": 3},
            {"prompt": "Add.", "environment": "calculator"},
            {**coding_tasks(1, seed=0)[0], "environment": "coding"},
            {"prompt": "?", "environment": "chess"},
        ]
        counter, calculator, coding, unknown = env.reset(rows)
        assert [t["function"]["name"] for t in counter.tools] == ["increment"]
        assert [t["function"]["name"] for t in calculator.tools] == ["calculator"]
        assert [t["function"]["name"] for t in coding.tools] == ["read_file", "write_file", "run_tests"]
        assert counter.messages[0]["content"] == "Count. Reach 3."
        assert isinstance(unknown, EnvFailure) and "'chess', not one of counter, calculator, coding" in unknown.message
        a, b, c = env.step(
            [counter.state, calculator.state, coding.state],
            [_call("increment", step=3), _call("calculator", expression="2 + 3"), _call("run_tests")],
        )
        assert a.messages[0]["content"] == "3" and b.messages[0]["content"] == "5"
        assert c.messages[0]["content"].startswith("exit code 1") and "AssertionError" in c.messages[0]["content"]
        (wrong,) = env.step([calculator.state], [_call("increment", step=1)])  # the other class's tool
        assert "no tool named 'increment'" in wrong.messages[0]["content"]
        (end,) = env.step([a.state], [ParsedTurn("Done.", "Done.")])
        assert end.done and end.reward == 1.0
        with pytest.raises(ValueError, match="environment_kwargs names coder, not an environment of the mapping"):
            EnvironmentRunner(spec, {"coder": {"wall_s": 7}}, pool, timeout_s=30.0).check()
    finally:
        pool.close()
    # the metrics split by the environment each row chose, whatever the routing column is called
    agent = AgentConfig(environment=spec, environment_kwargs={"column": "env"})
    renamed = [{"env" if k == "environment" else k: v for k, v in r.items()} for r in rows]
    episodes = [
        Episode(r, turns=t, finish=f, environment=environment_of(r, agent))
        for r, t, f in zip(renamed, (2, 1, 1, 0), ("done",) * 3 + ("failed",))
    ]
    assert environment_of(rows[0], AgentConfig(environment="tools")) is None
    m = episode_metrics(episodes)
    assert (m["agent/counter/turns"], m["agent/calculator/turns"], m["agent/chess/failed"]) == (2.0, 1.0, 1.0)
    assert m["agent/coding/turns"] == 1.0


@pytest.mark.integration
@pytest.mark.serial
def test_grpo_trains_on_a_trl_class_and_the_coding_environment_on_vllm(tmp_path):
    """GRPO on the vLLM sampler (float32, on Ray) over a mapping of a TRL-style class and the sandboxed coding
    environment, rows of both in every step. A scripted model (Qwen2.5's template, Hermes calls) calls the
    calculator or answers at once, about as often (sampling at temperature 1 on logits of 10): the class runs its calls
    on the episode's instance, its `get_reward()` is the calls made, so episodes differ and the step has a gradient;
    the coding episodes' calculator calls are answered with the coding tools' error and their answers go to the
    verifier in the sandbox (0: nothing was fixed). Token in / token out: the trainer's log-probs of the model's
    tokens equal vLLM's, with the tool results between the turns."""
    from core.config_loader import load_config
    from posttrain.config import PostTrainConfig
    from posttrain.grpo import GRPO
    from rollout.coding_env import coding_tasks
    from tests.helpers import step_metrics

    tok, model = _calls_or_answers(tmp_path)
    rows = [{"prompt": "What is 12 + 30?", "environment": "calculator"}] * 8
    rows += [{**r, "environment": "coding"} for r in coding_tasks(8, seed=0)]
    rows = [r for pair in zip(rows[:8], rows[8:], strict=True) for r in pair]  # alternating: both in every step
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    environments = {"calculator": "tests.trl_envs:CountingCalculator", "coding": "coding"}
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"checkpoint.init_from={model}",
            f"data.tokenizer_dir={tok.name_or_path}",
            f"data.source={data}",
            "data.eval_fraction=0",
            "rl.prompt_template='{prompt}'",
            "rollout.max_tokens=8",
            "rollout.max_model_len=2048",
            "rollout.kv_cache_gib=0.25",
            "train.steps=2",
            "rl.batch.prompts_per_step=2",
            "rl.batch.num_generations=8",
            "reward.functions=[]",
            "rl.accuracy_fn=null",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
            f"rl.agent={{environment: {json.dumps(environments)}, max_turns: 3}}",
            "rl.agent.environment_kwargs={coding: {wall_s: 10}}",
        ],
        schema=PostTrainConfig,
    )
    seen = step_metrics(cfg, GRPO, on_ray=True)
    print([{k: v for k, v in m.items() if k.startswith(("agent/", "reward/"))} for m in seen])
    assert len(seen) == 2
    for m in seen:
        assert m["agent/failed"] == 0 and m["agent/calculator/failed"] == 0 and m["agent/coding/failed"] == 0, m
        assert m["agent/coding/reward"] == 0.0  # nothing fixed
        assert np.isfinite(m["loss"])
    for name in ("calculator", "coding"):
        assert max(m[f"agent/{name}/turns"] for m in seen) > 1, seen  # calls answered, the episode went on
    assert all(m["agent/tool_calls"] > 0 and m["agent/env_tokens"] > 0 for m in seen)
    assert max(m["agent/calculator/reward"] for m in seen) > 0  # the class's get_reward, read at the answer
    assert seen[0]["mismatch/logp_gap_max"] < 1e-4, seen[0]
    assert any(m["grad_norm"] > 0 for m in seen)


def _calls_or_answers(tmp_path):
    """Qwen2.5's template with Hermes calls, and a scripted model that, at a generation prompt, calls the calculator
    or answers at once, about as often (temperature 1 on logits of 10): (the tokenizer, the model's directory)."""
    from core.chat import chat_prompt_ids
    from tests.test_agent_run import calling_agent, scripted_model

    tok, _, (start, body, end) = calling_agent(tmp_path)
    header = chat_prompt_ids(tok, [{"role": "user", "content": "What is 12 + 30?"}])[-1]
    successors = [(header, start), (start, body), (body, end), (end, tok.eos_token_id), (header, tok.eos_token_id)]
    return tok, scripted_model(tmp_path / "model8", tok, "qwen2", successors, scale=10.0)


@pytest.mark.integration
def test_a_run_over_a_trl_class_killed_mid_step_restarts_its_episodes_and_redoes_the_step(tmp_path):
    """`python -m recipes.grpo` over `CountingCalculator` (its instances live in the pool's workers, never pickled) on
    the JAX sampler, SIGKILLed with its workers (its process group) once step 3 is logged after checkpoint 2, then the
    same command again: the instances are gone with the workers, and nothing of them is in the checkpoint (it holds
    finished steps), so the resumed run starts step 3's episodes afresh from their rows, in new workers, with the
    request's seed it restored: step 3 logs what it logged before the kill (loss, the class's rewards, calls,
    turns), and no episode fails."""
    import sys

    from tests.test_grpo_e2e import assert_redone_steps_match, kill_9_and_resume

    tok, model = _calls_or_answers(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text((json.dumps({"prompt": "What is 12 + 30?"}) + "\n") * 8)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "recipes.grpo", "recipes/configs/grpo_tiny.yml",
        f"run.run_dir={run_dir}", f"checkpoint.init_from={model}", f"data.tokenizer_dir={tok.name_or_path}",
        f"data.source={data}", "data.eval_fraction=0", "rl.prompt_template='{prompt}'",
        "rollout.sampler=jax", "rollout.max_tokens=8", "rollout.max_model_len=768",
        "train.steps=4", "checkpoint.every_steps=2", "checkpoint.export_hf=false",
        "rl.batch.prompts_per_step=2", "rl.batch.num_generations=4", "reward.functions=[]", "rl.accuracy_fn=null",
        "rl.agent={environment: 'tests.trl_envs:CountingCalculator', max_turns: 3}",
    ]  # fmt: skip
    before_kill, after = kill_9_and_resume(cmd, run_dir, steps=4)
    keys = ("loss", "reward/mean", "agent/tool_calls", "agent/turns", "agent/failed", "agent/model_tokens")
    assert_redone_steps_match(before_kill, after, 2, keys=keys)
    assert all(m["agent/failed"] == 0 for m in after)
    assert len({m["reward/mean"] for m in after}) > 1 and any(m["agent/tool_calls"] > 0 for m in after)


def test_the_pool_runs_a_pinned_call_on_its_worker_and_says_where_each_ran():
    """`rewards.pool.Call.worker`: pinned calls run on that worker, unpinned ones anywhere; each result names its
    worker; a worker the pool does not have is an error, not a hang."""
    from rewards.pool import Call

    def where(worker=None):
        return Call("environment", "tests.reward_plugins:WhereAmI", {}, "pid", (), worker=worker)

    pool = WorkerPool(2)
    try:
        calls = [where(1), where(), where(1), where(0), where(1), where()]
        results = pool.call(calls, timeout=30.0)
        pids = {r.worker: r.value for r in results if r.error is None}
        assert set(pids) == {0, 1} and pids[0] != pids[1]
        for call, result in zip(calls, results, strict=True):
            assert result.error is None and result.value == pids[result.worker]
            if call.worker is not None:
                assert result.worker == call.worker
        (missing,) = pool.call([where(5)], timeout=30.0)
        assert missing.error is not None and "no worker 5" in missing.error
    finally:
        pool.close()
