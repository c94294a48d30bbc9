"""The worker pool that runs environments: calls that raise, hang, kill their worker or return garbage fail alone,
named; an environment that cannot be imported is named."""

from __future__ import annotations

import os
import time

import pytest

from rewards.pool import Call, WorkerPool
from rollout.environment import EnvFailure, Environment, EnvironmentRunner, EnvReply, EnvStart
from rollout.tool_parsing import ParsedTurn

# ------------------------------------------------------------------------------------------------- the pool


class Flaky(Environment):
    def __init__(self, mode: str = "ok"):
        self.mode = mode

    def reset(self, row):
        how = row.get("how", self.mode)
        if how == "raise":
            raise RuntimeError("reset broke")
        if how == "hang":
            time.sleep(60)
        if how == "die":
            os._exit(3)
        if how == "garbage":
            return {"messages": []}
        if how == "bad_messages":
            return EnvStart([{"content": "no role"}])
        if how == "unpicklable":
            return EnvStart([{"role": "user", "content": "x"}], state=lambda: 0)
        return EnvStart([{"role": "user", "content": str(row["prompt"])}], state=0)

    def step(self, state, turn):
        if turn.content == "nan":
            return EnvReply(reward=float("nan"), done=True, state=state)
        return EnvReply(
            [{"role": "user", "content": f"again {state + 1}"}], reward=1.0, done=state >= 1, state=state + 1
        )


def test_the_pool_runs_calls_and_a_call_that_raises_hangs_or_kills_fails_alone():
    pool = WorkerPool(2)
    try:
        spec = f"{__file__}:Flaky"
        runner = EnvironmentRunner(spec, {}, pool, timeout_s=3.0)
        runner.check()
        kinds = ["ok", "raise", "hang", "die", "garbage", "bad_messages", "unpicklable", "ok"]
        t0 = time.monotonic()
        out = runner.reset([{"prompt": f"p{i}", "how": k} for i, k in enumerate(kinds)])
        assert time.monotonic() - t0 < 20
        assert isinstance(out[0], EnvStart) and isinstance(out[-1], EnvStart) and out[-1].messages[0]["content"] == "p7"
        why = {k: o.message for k, o in zip(kinds, out) if isinstance(o, EnvFailure)}
        assert set(why) == set(kinds) - {"ok"}, why
        assert "reset broke" in why["raise"] and "timed out after 3 s" in why["hang"] and "died" in why["die"]
        assert "not a EnvStart" in why["garbage"] and "no role" in why["bad_messages"]
        assert "cannot be sent back" in why["unpicklable"]
        steps = runner.step([0, 0], [ParsedTurn("x", "x"), ParsedTurn("nan", "nan")])
        assert isinstance(steps[0], EnvReply) and steps[0].state == 1
        assert isinstance(steps[1], EnvFailure) and "not finite" in steps[1].message
        assert pool.call([Call("environment", spec, {}, "reset", ({"prompt": "z"},))], 3.0)[0].error is None
    finally:
        pool.close()


def test_an_environment_that_cannot_be_imported_is_named():
    from rewards.registry import UnknownReward

    with pytest.raises(UnknownReward, match="unknown environment 'no_such_env'"):
        EnvironmentRunner("no_such_env", {}, None, 1.0).check()  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- episodes
