"""Agents written against the `openai` client as a run's rollouts (`rl.agent.program`): GRPO trains on what their
calls sampled through the endpoint, on vLLM, token in / token out; every way a program can fail fails its episode
with the reason, counted; a program that cannot run is refused at start."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.test_agent_run import stopping_model


def _cfg(tmp_path, program: str, *overrides: str):
    from core.config_loader import load_config
    from posttrain.config import PostTrainConfig
    from tests.chat_families import FAMILIES, chat_tokenizer

    tok = chat_tokenizer(tmp_path / "tokenizer", "qwen2_5", spec={**FAMILIES["qwen2_5"], "eos": "<|endoftext|>"})
    model = stopping_model(tmp_path / "model", tok, "qwen2", share=0.3, stop="<|im_end|>")  # replies end before 32
    common = [
        f"run.run_dir={tmp_path / 'run'}",
        f"checkpoint.init_from={model}",
        f"data.tokenizer_dir={tok.name_or_path}",
        "rollout.sampler=jax",
        "rollout.max_tokens=32",
        "rollout.max_model_len=256",
        "train.steps=2",
        "rl.batch.prompts_per_step=2",
        "rl.batch.num_generations=4",
        "reward.functions=[]",
        "rl.accuracy_fn=null",
        "checkpoint.export_hf=false",
        f"rl.agent={{program: 'tests.agent_programs:{program}', program_timeout_s: 20}}",
    ]
    return load_config("recipes/configs/grpo_tiny.yml", [*common, *overrides], schema=PostTrainConfig)


@pytest.mark.integration
@pytest.mark.serial
def test_grpo_trains_on_what_an_openai_client_agents_calls_sampled_on_vllm(tmp_path):
    """Each episode is `summarises`: three calls through its own base URL on the vLLM sampler on Ray (float32), the
    second extending the first (the reply sent back as the client got it, then a user turn), the third from a summary
    of them: two segments, both trained, with the episode's advantage (the program's reward). Token in / token out:
    the trainer's log-prob of every token the model wrote, in both segments, equals the one vLLM returned with it (a
    re-rendered reply, the user turns' tokens counted as the model's, or a segment packed behind another's context
    would not)."""
    from posttrain.grpo import GRPO
    from tests.helpers import step_metrics

    cfg = _cfg(tmp_path, "summarises", "rollout.sampler=vllm", "rollout.dtype=float32")
    seen = step_metrics(cfg, GRPO, on_ray=True)
    print({k: v for k, v in seen[-1].items() if k.startswith(("agent/", "mismatch/", "reward/"))})
    assert len(seen) == 2
    for m in seen:
        assert m["agent/failed"] == 0 and m["agent/turns"] == 3.0 and m["agent/segments"] == 2.0, m
        assert m["sequences"] == 16.0  # 8 episodes' two segments each, in the batch
        assert m["agent/env_tokens"] > 0 and m["agent/model_tokens"] > 0
        assert np.isfinite(m["reward/agent/mean"]) and np.isfinite(m["loss"])
    assert seen[0]["mismatch/logp_gap_max"] < 1e-4, seen[0]  # step 1 samples on the weights the trainer holds
    assert any(m["grad_norm"] > 0 for m in seen)


def test_every_way_a_program_fails_fails_its_episode_with_the_reason():
    """`ProgramRunner` in this process (a unit test of its own logic; the endpoint is never reached)."""
    from rollout.agent_program import ProgramRunner, episode_value

    cases = {
        "hangs": "did not finish in 0.5 s",
        "says_yes": "returned str, not a number",
        "raises": "the program raised",
    }
    for name, why in cases.items():
        ((value, error, lost),) = ProgramRunner(f"tests.agent_programs:{name}", 0.5).run(
            [{"prompt": "q"}], ["http://127.0.0.1:9/v1"]
        )
        assert value is None and why in error, (name, error)
        # a hang is retried; so is a call that cannot reach the endpoint (nothing listens on port 9)
        assert lost == {"hangs": "timeout", "raises": "engine"}.get(name), (name, error)
    assert episode_value({"a": 1, "b": 2.5}) == ({"a": 1.0, "b": 2.5}, None)
    assert "not a finite number" in episode_value({"a": float("nan")})[1]
    assert episode_value(None) == (None, None) and episode_value(2) == (2.0, None)


def test_a_program_that_makes_no_call_or_returns_nothing_to_score_fails_its_episode():
    """`ProgramRollouts._episode` on what a step hands it (a unit test of its own rules; the run below shows the
    path end to end)."""
    from types import SimpleNamespace

    from posttrain.onpolicy.program import ProgramRollouts

    rollouts = SimpleNamespace(has_functions=False)
    row = {"prompt": "q"}
    silent = ProgramRollouts._episode(rollouts, row, [], 1.0, None)  # type: ignore[arg-type]
    assert silent.finish == "failed" and "made no call" in silent.error
    raised = ProgramRollouts._episode(rollouts, row, [], None, "the program raised ValueError: x")  # type: ignore[arg-type]
    assert raised.finish == "failed" and raised.error == "the program raised ValueError: x"


@pytest.mark.parametrize(
    "agent,message",
    [
        ("{program: 'tests.agent_programs:not_async'}", "is not a coroutine function"),
        ("{program: 'tests.agent_programs:nowhere'}", "rl.agent.program='tests.agent_programs:nowhere'"),
        ("{program: 'tests.agent_programs:chatter', environment: tools}", "leave rl.agent.environment"),
        ("{command: 'no-such-agent --x'}", "rl.agent.command='no-such-agent --x': 'no-such-agent' is not an"),
        ("{program: 'tests.agent_programs:chatter', command: 'python a.py'}", "two ways to run the agent: set one"),
        ("{program: 'tests.agent_programs:chatter', reasoning_parser: nope}", "unknown reasoning parser 'nope'"),
        ("{environment: tools, reasoning_parser: qwen3}", "reasoning_parser splits the replies of the endpoint"),
    ],
)
def test_a_program_that_cannot_run_is_refused_at_start(tmp_path, agent, message):
    from core.config_loader import ConfigError
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.run import build_sampler_run

    with pytest.raises(ConfigError, match=message):
        cfg = _cfg(tmp_path, "chatter", f"rl.agent={agent}")
        build_sampler_run(cfg, GRPO)


def test_an_episode_that_failed_before_its_prompt_keeps_its_place_in_the_batch():
    """A failed group's episode with no token at all (a reset that failed, a program that never called the model)
    takes one pad token in the trainer's batch, and trains nothing; the other group trains as it would."""
    from core.config_loader import load_config
    from posttrain.advantages import Advantages
    from posttrain.config import PostTrainConfig
    from posttrain.onpolicy.policy_gradient import rl_batch
    from rollout.sampler import Completion

    cfg = load_config("recipes/configs/grpo_tiny.yml", ["rl.batch.num_generations=2"], schema=PostTrainConfig)
    ok = Completion([5, 6], [7, 8], [-1.0, -1.0], "stop", "")
    empty = Completion([], [], [], "stop", "")
    keep = np.array([True, True, False, False])
    adv = Advantages(np.array([1.0, -1.0, 0.0, 0.0], np.float32), keep, keep, 0, 1)
    batch = rl_batch(cfg, [ok, ok, empty, empty], adv, row_len=32, row_multiple=1)
    mask = np.asarray(batch.loss_mask)
    assert mask[:2].sum() == 4 and mask[2:].sum() == 0


def test_on_policy_distillation_trains_nothing_of_a_failed_episode():
    """Both of on-policy distillation's batches (the sampled-token loss's and GKD's) hold a failed episode as one pad
    token, whether it failed before its prompt (no token at all) or part way (a partial trajectory): no target, no
    loss token; the others train on every model token."""
    from core.config_loader import load_config
    from posttrain.config import PostTrainConfig
    from posttrain.distill.onpolicy import gkd_batch, sampled_batch
    from posttrain.onpolicy.method import SampleContext
    from posttrain.onpolicy.step import Scored
    from rollout.episodes import Episode
    from rollout.sampler import Completion

    cfg = load_config(
        "recipes/configs/distill_tiny.yml",
        ["rl.batch.num_generations=2", "rl.batch.prompts_per_step=2", "distill.lmbda=1.0"],
        schema=PostTrainConfig,
    )
    ok = Completion([5, 6], [7, 8, 9], [-1.0] * 3, "stop", "", sampled=[True, False, True])
    partial = Completion([5, 6], [7, 8], [-1.0] * 2, "stop", "", sampled=[True, False])
    empty = Completion([], [], [], "stop", "")
    done, failed = Episode({}, finish="done"), Episode({}, finish="failed", error="its environment raised")
    scored = Scored([{}, {}], [ok, partial, empty, ok], None, None, [done, failed, failed, done])
    ctx = SampleContext(1, 64, 1, None, lambda: scored)
    mask = np.asarray(sampled_batch(cfg, scored, ctx).batch.loss_mask)
    assert mask.sum(axis=1).tolist() == [2, 0, 0, 2]
    targets = np.asarray(gkd_batch(cfg, scored, ctx).batch.packed.target_mask)
    assert targets.sum(axis=1).tolist() == [2, 0, 0, 2]


def test_what_counts_as_a_failure_outside_the_model():
    """`lost`: the endpoint unreachable or answering 5xx (an engine failed) is retried; a refusal (4xx) or the
    agent's own exception is not."""
    import httpx
    import openai

    from rollout.agent_program import lost

    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")

    def status(code: int) -> openai.APIStatusError:
        cls = openai.InternalServerError if code >= 500 else openai.BadRequestError
        return cls("x", response=httpx.Response(code, request=request), body=None)

    assert lost(openai.APIConnectionError(request=request)) and lost(openai.APITimeoutError(request))
    assert lost(status(500)) and lost(status(503))
    assert not lost(status(400)) and not lost(ValueError("the agent's bug"))


def _program_episodes(
    tmp_path, program: str, rows: list[dict], n: int, *overrides: str, wrap=lambda t: t, segments: bool = True
):
    """`ProgramRollouts.run` of `rows` (`n` episodes each) on the JAX sampler's slots (`wrap`ped), with a worker pool
    of one; `segments`: the method trains an episode's several trajectories."""
    from types import SimpleNamespace

    from core.chat_template import turn_stop_ids
    from core.data import load_tokenizer
    from core.hf.directory import load_hf
    from posttrain.onpolicy.program import ProgramRollouts
    from rewards.pool import WorkerPool
    from rollout.jax_engine import SlotTurns
    from rollout.jax_sampler import JaxSampler
    from rollout.sampler import SamplingParams

    cfg = _cfg(tmp_path, program, *overrides)
    tok = load_tokenizer(cfg.data.tokenizer_dir)
    sampler = JaxSampler(load_hf(cfg.checkpoint.init_from)[0], cfg.data.tokenizer_dir, max_model_len=256, seed=0)
    samplers = SimpleNamespace(turns=lambda k: wrap(SlotTurns(sampler, slots=4)))
    pool = WorkerPool(1)
    try:
        rollouts = ProgramRollouts(cfg, cfg.data.tokenizer_dir, pool, has_functions=False, segments=segments)
        params = SamplingParams(n=n, temperature=1.0, max_tokens=8, seed=0, stop_token_ids=turn_stop_ids(tok))
        episodes = rollouts.run(rows, params, samplers).episodes  # type: ignore[arg-type]
    finally:
        pool.close()
    assert episodes is not None and len(episodes) == n * len(rows)
    return episodes


def test_an_episode_whose_program_hung_runs_again_afresh_and_is_counted(tmp_path):
    """Of a row's four episodes the first to start hangs (past `program_timeout_s`): it runs again from its row on a
    fresh URL and ends like the others, its attempt counted (`agent/retries/timeout`). (Without a retry it would
    fail with the runner's reason, "did not finish in 15 s": `ProgramRunner`'s test above.)"""
    from posttrain.onpolicy.agent import episode_metrics

    rows = [{"question": "What is 1 + 1?", "marker": str(tmp_path / "marker")}]
    overrides = ("rl.agent.retries=1", "rl.agent.program_timeout_s=15")  # the others' calls finish well inside it
    episodes = _program_episodes(tmp_path, "hangs_once", rows, 4, *overrides)
    hung = [e for e in episodes if e.retried or e.finish == "failed"]
    assert len(hung) == 1, [(e.finish, e.error, e.retried) for e in episodes]
    assert hung[0].retried == ["timeout"] and hung[0].finish == "done" and hung[0].rewards == [1.0]
    assert episode_metrics(episodes)["agent/retries/timeout"] == 0.25
    assert all(e.finish == "done" and e.rewards == [1.0] for e in episodes if e is not hung[0])


def test_every_way_a_command_fails_fails_its_episode_with_the_reason(tmp_path):
    """`CommandRunner` in this process (nothing listens at the URL: the failures come before any call, or from it)."""
    import sys

    from rollout.agent_program import CommandRunner

    script = tmp_path / "agent.py"
    cases = {
        "import sys; sys.exit('broken')": ("exited with status 1: broken", None),
        "print('no json here')": ("last line is not JSON: 'no json here'", None),
        "pass": ("printed nothing", None),
        "print('\"yes\"')": ("the command returned str", None),
        "import time; time.sleep(60)": ("did not finish in 1 s", "timeout"),
    }
    for code, (why, lost) in cases.items():
        script.write_text(code)
        ((value, error, was_lost),) = CommandRunner(f"{sys.executable} {script}", 1.0).run([{"prompt": "q"}], ["x"])
        assert value is None and why in error and was_lost == lost, (code, error)
    script.write_text("import json, sys; row = json.load(sys.stdin); print(json.dumps(len(row['prompt'])))")
    assert CommandRunner(f"{sys.executable} {script}", 5.0).run([{"prompt": "four"}], ["x"]) == [(4.0, None, None)]
    script.write_text("print('null')")
    assert CommandRunner(f"{sys.executable} {script}", 5.0).run([{"prompt": "q"}], ["x"]) == [(None, None, None)]
    with pytest.raises(ValueError, match="not an executable"):
        CommandRunner("no-such-agent --flag", 1.0)
    # what a command started goes with it on a timeout (its process group)
    pids = tmp_path / "pids"
    script.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    ((_, error, lost),) = CommandRunner(f"{sys.executable} {script}", 2.0).run([{"prompt": "q"}], ["x"])
    assert lost == "timeout"
    assert _gone(int(pids.read_text())), "the command's own child outlived it"


def test_a_command_dies_with_the_worker_that_started_it(tmp_path):
    """The pool kills a worker past its deadline (here shorter than the command's own timeout): the command it
    started goes too, not left running beside the run."""
    import sys

    from rewards.pool import Call, WorkerPool

    pid = tmp_path / "pid"
    script = tmp_path / "agent.py"
    script.write_text(f"import os, time\nopen({str(pid)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    kwargs = {"command": f"{sys.executable} {script}", "timeout_s": 60.0}
    pool = WorkerPool(1)
    try:
        call = Call("agent", "rollout.agent_program:CommandRunner", kwargs, "run", ([{"prompt": "q"}], ["x"]))
        (result,) = pool.call([call], timeout=8.0)  # long enough to start under load, far short of its own 60 s
    finally:
        pool.close()
    assert result.error is not None and result.error.startswith("timed out"), result
    assert _gone(int(pid.read_text())), "the command outlived its worker"


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` has exited (a zombie awaiting its reaper counts as gone)."""
    import time

    import psutil

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


class FailingOnce:
    """The sampler's turns, whose first `take` raises (an engine that failed with turns in flight)."""

    def __init__(self, turns):
        self.turns, self.failed = turns, False

    def put(self, requests):
        self.turns.put(requests)

    def take(self):
        if not self.failed:
            self.failed = True
            self.turns.take()  # what the engine had in flight is lost with it
            raise RuntimeError("the engine died")
        return self.turns.take()


def test_an_agent_run_as_a_command_whose_call_the_engine_failed_runs_again_and_is_counted(tmp_path):
    """`rl.agent.command`: `tests/agent_command.py`, a process per episode with the `openai` client reading
    `OPENAI_BASE_URL` itself and the row on stdin. The engine fails the first turns in flight: the endpoint answers
    those calls 500 and the command exits non-zero; since the endpoint failed one of its calls (it records them: a
    program that lets the `openai` error raise is classed the same way, `lost` above) the episode runs again,
    counted as `engine`. Every episode ends done, its call its trajectory, the JSON object it printed last its
    reward (summed)."""
    from posttrain.onpolicy.agent import episode_metrics

    command = f"rl.agent={{command: '{sys.executable} tests/agent_command.py', program_timeout_s: 60}}"
    rows = [{"question": "What is 1 + 1?"}]
    episodes = _program_episodes(tmp_path, "chatter", rows, 3, command, wrap=FailingOnce)
    assert all(e.finish == "done" for e in episodes), [(e.finish, e.error) for e in episodes]
    for e in episodes:
        assert e.turns == 1 and any(e.sampled) and e.prompt_ids
        assert len(e.rewards) == 1 and 1.0 <= e.rewards[0] <= 3.0  # called + length % 3
    retried = [e.retried for e in episodes if e.retried]
    assert retried and all(r == ["engine"] for r in retried), [e.retried for e in episodes]
    assert episode_metrics(episodes)["agent/retries/engine"] == len(retried) / 3


@pytest.mark.integration
def test_a_run_of_openai_client_agents_killed_mid_episode_resumes_exactly(tmp_path):
    """`python -m recipes.grpo` with `chatter` as the agent on the JAX sampler (single controller: the sampler in the
    trainer's process), a policy of LoRA adapters (the sampler holds the base and takes the adapters after each
    update), SIGKILLed one step after checkpoint 2 (step 4's episodes running), then the same command again: it
    resumes from checkpoint 2, every step is logged once, and step 3, sampled again from its rows, logs what it
    logged before the kill (the request's seed is restored, each episode's turns draw from it and its index). The
    sampler serves the adapted policy throughout: its log-probs stay the trainer's."""
    from tests.chat_families import FAMILIES, chat_tokenizer
    from tests.test_grpo_e2e import assert_redone_steps_match, kill_9_and_resume

    tok = chat_tokenizer(tmp_path / "tokenizer", "qwen2_5", spec={**FAMILIES["qwen2_5"], "eos": "<|endoftext|>"})
    model = stopping_model(tmp_path / "model", tok, "qwen2", share=0.3, stop="<|im_end|>")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "recipes.grpo",
        "recipes/configs/grpo_tiny.yml",
        f"run.run_dir={run_dir}",
        f"checkpoint.init_from={model}",
        f"data.tokenizer_dir={tok.name_or_path}",
        "rollout.sampler=jax",
        "rollout.max_tokens=32",
        "rollout.max_model_len=256",
        "train.steps=4",
        "checkpoint.every_steps=2",
        "checkpoint.export_hf=false",
        "rl.batch.prompts_per_step=2",
        "rl.batch.num_generations=4",
        "reward.functions=[]",
        "rl.accuracy_fn=null",
        "rl.agent={program: 'tests.agent_programs:chatter', program_timeout_s: 60}",
        *("model.lora.rank=4", "model.lora.alpha=16", "optim.learning_rate=1.0e-2"),
    ]
    before_kill, after = kill_9_and_resume(cmd, run_dir, steps=4)
    keys = ("loss", "reward/mean", "agent/model_tokens", "agent/turns", "agent/failed", "policy_version")
    assert_redone_steps_match(before_kill, after, 2, keys=(*keys, "mismatch/logp_gap_mean"))
    assert all(m["agent/turns"] > 2 for m in after), [m["agent/turns"] for m in after]  # the agent's calls
    # the sampler serves the adapted policy (its adapters moved: a sampler left on the base would drift away)
    assert all(m["mismatch/logp_gap_mean"] < 1e-5 for m in after), [m["mismatch/logp_gap_mean"] for m in after]
    assert after[-1]["loss"] != after[0]["loss"]
