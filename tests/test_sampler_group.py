"""The samplers of an on-policy run as one (`rollout.group.SamplerGroup`): a failed sampler restarted and its share
redone, once; one whose node left (or crashed) dropped while the run goes on; bad input passed through."""

import pytest

from rollout.group import SamplerFailed, SamplerGroup, SamplerInputError
from rollout.sampler import Completion, SamplingParams


class _FakeRemote:
    """A sampler with the Ray client's surface: `fail` (an exception or None) makes `result` / `update_weights`
    raise it, as a dead actor (RayActorError) or a failing engine (RayTaskError) would."""

    remote = True

    def __init__(self, tag, fail=None, fail_sync=None, alive=True):
        self.tag, self.fail, self.fail_sync, self.policy_version = tag, fail, fail_sync, 0
        self.killed, self.offsets, self.alive = False, [], alive

    def submit(self, prompts, params):
        self.offsets.append(params.prompt_offset)
        return list(prompts)

    def result(self, ref):
        if self.fail is not None:
            raise self.fail
        return [Completion([], [], None, "stop", f"{self.tag}:{p}") for p in ref]

    def generate(self, prompts, params):
        return self.result(self.submit(prompts, params))

    def push(self):
        if self.fail_sync is not None:
            raise self.fail_sync
        return self.tag

    def stop(self):
        self.killed = True

    def node_alive(self):
        """`alive`: a bool, or a list of answers given in turn (a node Ray sees dead only later)."""
        return self.alive.pop(0) if isinstance(self.alive, list) else self.alive


def _task_error(cause):
    import ray.exceptions

    return ray.exceptions.RayTaskError("generate", "traceback", cause)


def test_sampler_group_restarts_a_failed_sampler_and_keeps_order():
    import ray.exceptions

    for failure in (ray.exceptions.RayActorError(), _task_error(RuntimeError("engine out of memory"))):
        restarted, pushed = [], []

        def restart(i, restarted=restarted):
            restarted.append(i)
            return _FakeRemote(f"new{i}")

        dead = _FakeRemote("b", fail=failure)
        group = SamplerGroup([_FakeRemote("a"), dead], restart=restart)
        pending = group.submit(["p0", "p1", "p2", "p3"], SamplingParams(seed=3))
        out = group.collect(pending, push=pushed.append)
        assert [c.text for c in out] == ["a:p0", "a:p1", "new1:p2", "new1:p3"]
        assert restarted == [1] and pushed == [group.samplers[1]] and dead.killed
        assert group.restarts == 1 and group.redone_prompts == 2
        # each sampler's slice carries its offset in the whole request (per-sample seeds do not depend on the split)
        assert group.samplers[0].offsets == [0] and dead.offsets == [2] and group.samplers[1].offsets == [2]


def test_sampler_group_stops_on_a_second_failure_and_passes_bad_input_through():
    import ray.exceptions

    group = SamplerGroup(
        [_FakeRemote("a", fail=ray.exceptions.RayActorError())],
        restart=lambda i: _FakeRemote("again", fail=ray.exceptions.RayActorError()),
    )
    with pytest.raises(SamplerFailed, match="sampler 0 failed again right after a restart"):
        group.collect(group.submit(["p"], SamplingParams()), push=lambda s: None)
    assert group.restarts == 1
    bad_input = SamplerGroup(
        [_FakeRemote("a", fail=_task_error(ValueError("prompt 0 has 300 tokens")))],
        restart=lambda i: pytest.fail("bad input is not a sampler failure"),
    )
    with pytest.raises(SamplerInputError, match="sampler 0 refused its prompts: prompt 0 has 300 tokens"):
        bad_input.collect(bad_input.submit(["p"], SamplingParams()), push=lambda s: None)
    no_restart = SamplerGroup([_FakeRemote("c", fail=ray.exceptions.RayActorError())])
    with pytest.raises(ray.exceptions.RayActorError):  # without a restart function the failure surfaces
        no_restart.collect(no_restart.submit(["p"], SamplingParams()), push=lambda s: None)


def test_sampler_group_drops_a_sampler_whose_node_left_and_goes_on_with_the_rest():
    """Sampler b's node is gone: b is not restarted but dropped; its part of the request is redone by a survivor
    with b's prompt offsets (the same seeds), the next request and sync use the survivors only, and when the
    last sampler's node goes too the run stops with a message."""
    import ray.exceptions

    lost = ray.exceptions.RayActorError()
    a, b = _FakeRemote("a"), _FakeRemote("b", fail=lost, fail_sync=lost, alive=False)
    group = SamplerGroup([a, b, _FakeRemote("c")], restart=lambda i: pytest.fail("a node that left is not restarted"))
    out = group.collect(group.submit(["p0", "p1", "p2", "p3", "p4", "p5"], SamplingParams(seed=3)), push=print)
    assert [x.text for x in out] == ["a:p0", "a:p1", "a:p2", "a:p3", "c:p4", "c:p5"]
    assert a.offsets == [0, 2] and b.killed and group.dropped == 1 and group.restarts == 0
    assert group.samplers == [a, group.samplers[1]] and group.slots == [0, 2]
    assert [x.text for x in group.collect(group.submit(["q0", "q1"], SamplingParams()), push=print)] == [
        "a:q0",
        "c:q1",
    ]
    assert group.sync(lambda s: s.push()) == ["a", "c"]
    dying = _FakeRemote("d", fail_sync=lost, alive=False)
    alone = SamplerGroup([dying], restart=lambda i: pytest.fail("not restarted"))
    with pytest.raises(SamplerFailed, match="sampler 0's node left the cluster .* no sampler is left"):
        alone.sync(lambda s: s.push())


def test_sampler_group_drops_a_sampler_whose_node_crashed_once_its_restart_fails():
    """A crashed node is still alive to Ray when its sampler's death arrives: the restart is tried, fails (its
    bundle's node is gone), and then the node is seen dead: the sampler is dropped, not the run stopped. On a
    node that is still alive, the failed restart stops the run as before."""
    import ray.exceptions

    lost = ray.exceptions.RayActorError()
    tries = []

    def restart(i):
        tries.append(i)
        raise ray.exceptions.GetTimeoutError("the actor could not be scheduled")

    a, b = _FakeRemote("a"), _FakeRemote("b", fail=lost, alive=[True, False])
    group = SamplerGroup([a, b], restart=restart)
    out = group.collect(group.submit(["p0", "p1"], SamplingParams()), push=print)
    assert [x.text for x in out] == ["a:p0", "a:p1"] and tries == [1]
    assert group.samplers == [a] and group.dropped == 1 and group.restarts == 0
    alive = SamplerGroup([_FakeRemote("a"), _FakeRemote("b", fail=lost, alive=True)], restart=restart)
    with pytest.raises(SamplerFailed, match="sampler 1 failed again right after a restart"):
        alive.collect(alive.submit(["p0", "p1"], SamplingParams()), push=print)


def test_sampler_group_sync_replaces_a_sampler_that_died_since():
    import ray.exceptions

    dead = _FakeRemote("b", fail_sync=ray.exceptions.RayActorError())
    group = SamplerGroup([_FakeRemote("a"), dead], restart=lambda i: _FakeRemote(f"new{i}"))
    assert group.sync(lambda s: s.push()) == ["a", "new1"]
    assert dead.killed and group.restarts == 1 and group.samplers[1].tag == "new1"
