"""The shapes a learner's update runs in (`core.shape_plan`): padding into a larger shape changes no value, a growing
run finds its next shape compiled ahead, a bucket padded often is compiled in the background, and the learner's
updates are the same with and without compiling ahead."""

import threading
import time

import jax
import numpy as np
import pytest

from core.compile_cache import BACKGROUND_PREFIX
from core.config import MeshConfig, ModelConfig, OptimConfig
from core.mesh import make_mesh
from core.models import create_model
from core.shape_plan import Need, Shape, ShapePlan, apply, bucket, grow
from core.targets import target_logprobs
from core.train import split_micro_batches
from posttrain.onpolicy.rl_batch import build_rl_batch
from rollout.sampler import Completion

SGD = OptimConfig(name="sgd", learning_rate=0.1, schedule="constant", grad_clip_norm=None)


def rl_batch(lengths, groups=2, row_len=64, seed=0, per_prompt=2):
    """A policy-gradient batch of completions of `lengths` tokens, `per_prompt` sharing each prompt, packed several
    to a row."""
    rng = np.random.RandomState(seed)
    completions = []
    for i, n in enumerate(lengths):
        prompt = [7 + i // per_prompt] * 6
        ids = rng.randint(1, 500, n).tolist()
        completions.append(Completion(prompt, ids, [-1.0] * n, "stop", "", 0))
    adv = rng.randn(len(lengths)).astype(np.float32)
    return build_rl_batch(completions, adv, np.ones(len(lengths), bool), row_len=row_len, max_tokens=32, groups=groups)


def logprobs_in(model, batch, shape, need):
    """[B, C] log-probs of the batch laid out in `shape`, a packing group at a time."""
    shaped = apply(batch, shape, need)
    micro = split_micro_batches(shaped.packed, need.groups, set_counts=False)
    return np.concatenate(
        [np.asarray(target_logprobs(model, jax.tree.map(lambda x, g=g: x[g], micro))[0]) for g in range(need.groups)]
    )


def test_a_batch_padded_into_a_larger_shape_scores_every_target_the_same():
    """Two empty rows at the end of each packing group, every target slot scored, every position run: the same
    log-probs as the batch in its own bucket (a target's index into its group's positions is unchanged)."""
    model = create_model(ModelConfig(), None, seed=0)
    batch = rl_batch([5, 9, 14, 3, 20, 11, 7, 16])
    need = Need(batch, {})
    own = bucket(need, 1)
    big = Shape(own.rows + 2, need.scored_slots, need.positions(own.rows + 2))
    shaped = apply(batch, big, need)
    assert shaped.packed.tokens.shape[0] == 2 * (own.rows + 2) > batch.packed.tokens.shape[0]  # rows were padded
    assert own.scored < need.scored_slots  # the own bucket scores fewer slots than the padded one
    mask = np.asarray(batch.packed.target_mask) > 0
    mine, padded = logprobs_in(model, batch, own, need), logprobs_in(model, batch, big, need)
    assert np.abs(mine[mask]).min() > 0
    np.testing.assert_allclose(padded[mask], mine[mask], rtol=1e-5, atol=1e-5)


def test_an_offline_batch_keeps_its_rows():
    """A batch whose every row is its own scored sequence (the offline pipelines') has nothing to pack into more
    rows: the shape compiled ahead grows its counts, not its rows. A packed RL batch grows its rows too."""
    from core.data import to_data_batch

    rows = np.ones((4, 16), np.int32)
    offline = to_data_batch(
        {
            "tokens": rows,
            "segment_ids": rows,
            "positions": np.tile(np.arange(16), (4, 1)),
            "loss_mask": rows,
            "example_ids": rows,
        },
        1,
    ).batch
    need = Need(offline, {})
    assert not need.rows_vary and grow(bucket(need, 1), need, 1).rows == 4
    packed = rl_batch([5, 9, 14, 3, 20, 11, 7, 16], groups=1)
    need = Need(packed, {})
    assert need.rows_vary and grow(bucket(need, 1), need, 1).rows > bucket(need, 1).rows


class Recorder:
    """A stand-in for the learner's compiler: the shapes it was asked for, and from which thread."""

    def __init__(self, seconds=0.0):
        self.calls: list[tuple[tuple, bool]] = []
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        p = batch.packed
        self.calls.append(
            ((p.tokens.shape[0], p.scored, p.compact), threading.current_thread().name.startswith(BACKGROUND_PREFIX))
        )

    @property
    def foreground(self):
        return [c for c, background in self.calls if not background]


def settle(plan):
    for pending in plan.pending.values():
        for future in list(pending.values()):
            future.result(timeout=30)


def test_a_growing_run_finds_its_next_shape_compiled_ahead():
    """The first batch compiles its bucket while the step waits, and the shape of a batch half as large again in the
    background; a batch 1.4x as large then runs in that shape with no compilation in the foreground. Without
    compiling ahead the same batch compiles while the step waits."""
    small = rl_batch([10] * 8)
    larger = rl_batch([14, 13, 14, 12, 14, 13, 14, 12])
    assert Need(larger, {}).rows > Need(small, {}).rows  # it needs more rows: the growth is real
    for ahead in (True, False):
        compiled = Recorder()
        plan = ShapePlan(compiled, {}, 1, ahead=ahead)
        first, _ = plan.shape(small)
        settle(plan)
        second, _ = plan.shape(larger)
        if ahead:
            assert len(compiled.foreground) == 1 and len(compiled.calls) == 2
            assert second == grow(first, Need(small, {}), 1)
        else:
            assert len(compiled.foreground) == 2


def test_a_bucket_padded_often_is_compiled_in_the_background_and_then_used():
    """Smaller batches pad into the compiled shape (no compilation); after `patience` of them their own bucket is
    compiled in the background, and the next one runs in it. A shape not ready on every process (agree False) is
    never used: a batch that needs more than what is compiled compiles in the foreground instead."""
    big = rl_batch([20, 22, 24, 20, 22, 24, 20, 22], row_len=64)
    small = rl_batch([10, 11, 12, 10, 11, 12, 10, 11], row_len=64)
    compiled = Recorder()
    plan = ShapePlan(compiled, {}, 1, ahead=True, patience=2)
    large_shape, _ = plan.shape(big)
    settle(plan)
    own = bucket(Need(small, {}), 1)
    assert own != large_shape
    for _ in range(2):
        shape, _ = plan.shape(small)
        assert shape != own
    settle(plan)
    assert plan.shape(small)[0] == own
    assert len(compiled.foreground) == 1

    mid = rl_batch([14, 13, 14, 12, 14, 13, 14, 12])  # fits the shape compiled ahead, in another bucket of its own
    ahead = grow(bucket(Need(small, {}), 1), Need(small, {}), 1)
    assert bucket(Need(mid, {}), 1) != ahead
    for agreed in (True, False):
        compiled = Recorder()
        plan = ShapePlan(compiled, {}, 1, ahead=True, agree=lambda flag, agreed=agreed: flag and agreed)
        plan.shape(small)
        settle(plan)
        shape, _ = plan.shape(mid)
        assert shape == (ahead if agreed else bucket(Need(mid, {}), 1))
        assert len(compiled.foreground) == (1 if agreed else 2)


def test_a_shape_whose_compilation_ahead_failed_is_compiled_when_a_batch_needs_it():
    """The background compilation of the grown shape raises: it is never taken as compiled, and the larger batch
    compiles the shape it runs in while its step waits. Waiting for a shape still compiling ahead: one that failed,
    here or on another process of the group (agree False), is compiled in the foreground; one that succeeded
    everywhere is not."""
    from concurrent.futures import Future

    small = rl_batch([10] * 8)
    larger = rl_batch([14, 13, 14, 12, 14, 13, 14, 12])

    class FailsAhead(Recorder):
        def __call__(self, batch):
            super().__call__(batch)
            if threading.current_thread().name.startswith(BACKGROUND_PREFIX):
                raise RuntimeError("out of memory while compiling ahead")

    compiled = FailsAhead()
    plan = ShapePlan(compiled, {}, 1, ahead=True)
    first, _ = plan.shape(small)
    grown = grow(first, Need(small, {}), 1)
    settle_failed = [f.exception(timeout=30) for p in plan.pending.values() for f in p.values()]
    assert settle_failed and all(isinstance(e, RuntimeError) for e in settle_failed)
    second, _ = plan.shape(larger)
    assert grown not in plan.ready[Need(larger, {}).family] and second != grown
    assert len(compiled.foreground) == 2  # the small batch's bucket, then the larger one's

    def finished(error=None):
        future = Future()
        future.set_exception(error) if error else future.set_result(None)
        return future

    for future, agreed, compiles in [
        (finished(RuntimeError("failed here")), True, 1),
        (finished(), False, 1),  # failed on another process
        (finished(), True, 0),
    ]:
        calls = []
        group = ShapePlan(Recorder(), {}, 1, agree=lambda flag, agreed=agreed: flag and agreed)
        group._wait_for(future, lambda calls=calls: calls.append(1))
        assert len(calls) == compiles


@pytest.mark.parametrize("micro", [1, 2])
def test_the_learner_updates_alike_with_and_without_compiling_ahead(micro):
    """Three batches that grow: a learner compiling ahead runs the later ones padded into shapes compiled in the
    background, one that does not compiles each in the foreground; both take the same updates (loss, gradient
    norm, parameters), on a non-zero gradient."""
    from core.compile_cache import compile_clock
    from core.learner import Learner
    from posttrain.losses.policy import PolicyLossSettings
    from posttrain.onpolicy.policy_gradient import policy_objective

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    batches = [
        rl_batch([10] * 8, groups=micro, seed=0),
        rl_batch([14, 13, 14, 12, 14, 13, 14, 12], groups=micro, seed=1),
        rl_batch([11, 12, 11, 12, 11, 12, 11, 12], groups=micro, seed=2),
    ]
    loss = policy_objective(PolicyLossSettings(max_tokens=32))
    results, foreground = {}, {}
    for ahead in (True, False):
        learner = Learner(create_model(ModelConfig(), mesh, seed=0), mesh, loss, SGD, 3, compile_ahead=ahead)
        clock, updates = compile_clock(), []
        for b in batches:
            before = clock.read()
            updates.append(learner.update(b, micro))
            if ahead:
                settle(learner.plan)  # the background compilation finishes between steps, as it would during rollouts
            waited = clock.read() - before  # compiled or loaded from the session's cache while the step waited
            foreground.setdefault(ahead, []).append(waited.compiles + waited.cache_hits)
        results[ahead] = (updates, jax.tree.map(np.asarray, learner.state.params))
    for with_, without in zip(results[True][0], results[False][0]):
        assert with_.applied and with_.grad_norm > 0
        np.testing.assert_allclose(with_.loss, without.loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(with_.grad_norm, without.grad_norm, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(results[True][1]), jax.tree.leaves(results[False][1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert foreground[False][1] > 0  # the second batch's shape was new: compiled (or loaded) while the step waited
    assert foreground[True][1] == 0  # compiled ahead


def test_a_frozen_pass_pads_a_batch_into_rows_it_ran_and_scores_it_the_same():
    """A reference's or teacher's log-prob pass (`posttrain.frozen.grouped_logprobs`) on a batch packed into fewer
    rows than one before: padded into the row count it already ran (no new compilation), the same log-probs as the
    batch scored in its own rows."""
    from posttrain.frozen import LogprobPass, grouped_logprobs

    model = create_model(ModelConfig(), None, seed=0)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    long, short = rl_batch([20, 18, 21, 19, 17, 20, 22, 16]), rl_batch([12, 13, 12, 14, 13, 12, 14, 12], seed=1)
    assert Need(short, {}).rows < Need(long, {}).rows  # the second batch packs into fewer rows
    shared = LogprobPass(1.0)
    grouped_logprobs(shared, model, long.packed, mesh)
    compiled = shared._jitted.jitted._cache_size()
    got = grouped_logprobs(shared, model, short.packed, mesh)
    assert shared._jitted.jitted._cache_size() == compiled  # the rows and counts it ran before
    need = Need(short, {})
    mine = logprobs_in(model, short, bucket(need, 1), need)
    mask = np.asarray(short.packed.target_mask) > 0
    assert np.abs(mine[mask]).min() > 0
    np.testing.assert_allclose(got[mask], mine[mask], rtol=1e-5, atol=1e-5)
