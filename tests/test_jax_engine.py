"""Continuous batching on the JAX sampler (`rollout.jax_engine.SlotTurns`): every turn samples what
`JaxSampler.generate` samples for the same request, an episode's next turn reuses its cache, and new prompt shapes
compile nothing."""

import dataclasses

import numpy as np
import pytest

from core.compile_cache import compile_clock
from core.hf.directory import load_hf
from rollout.jax_engine import SlotTurns
from rollout.jax_sampler import JaxSampler
from rollout.sampler import SamplingParams
from rollout.turns import TurnRequest


def sampler_for(path, max_model_len=96):
    model, _ = load_hf(path)
    return JaxSampler(model, str(path), max_model_len=max_model_len)


def requests(seed, temperature=1.0, top_k=-1):
    rng = np.random.RandomState(seed)
    out = []
    for key in range(7):
        prompt = rng.randint(3, 500, rng.randint(1, 40)).tolist()
        params = SamplingParams(
            temperature=temperature, top_k=top_k, max_tokens=int(rng.randint(1, 24)), seed=1000 + key
        )
        out.append(TurnRequest(key, prompt, params))
    return out


def drain(turns, reqs, put_at_once=3):
    """Put `put_at_once` requests, then one more each time a turn comes back (the episodes' way): key -> completion."""
    pending, got = list(reqs), {}
    turns.put(pending[:put_at_once])
    pending = pending[put_at_once:]
    while len(got) < len(reqs):
        for key, completion in turns.take():
            got[key] = completion
            if pending:
                turns.put([pending.pop(0)])
    return got


@pytest.mark.parametrize("temperature,top_k", [(0.0, -1), (1.0, -1), (0.7, 20)])
def test_each_turn_samples_what_the_sampler_samples_for_it(rollout_model_dir, temperature, top_k):
    """Seven requests of 1-39 prompt tokens and 1-23 new ones through 2 slots (prompts longer than a 16-token
    prefill chunk, slots taken over by new episodes, caches that start 32 positions wide and widen): the tokens,
    log-probs and finish reasons of `generate`."""
    sampler = sampler_for(rollout_model_dir("llama"))
    reqs = requests(0, temperature, top_k)
    turns = SlotTurns(sampler, slots=2, decode_steps=4, chunk=16, prefill_rows=2, width=32)
    got = drain(turns, reqs)
    assert turns.widths == [32, 64, 112] and turns._device[0].shape[2] > 32  # the caches widened on the way
    assert max(len(r.token_ids) for r in reqs) > 16
    for r in reqs:
        want = sampler.generate([r.token_ids], r.params)[0]
        assert got[r.key].token_ids == want.token_ids, r.key
        assert got[r.key].finish_reason == want.finish_reason
        np.testing.assert_allclose(got[r.key].logprobs, want.logprobs, atol=2e-5)
    assert any(c.finish_reason == "length" for c in got.values())


def test_an_episodes_next_turn_reuses_its_cache(rollout_model_dir):
    """Turn 2 of an episode is its first turn's context and tokens plus an environment's answer: the engine
    prefills the answer alone (its slot holds the rest) and samples what `generate` samples on the whole context.
    A turn that does not extend what the slot holds starts the slot again."""
    sampler = sampler_for(rollout_model_dir("qwen2"))
    turns = SlotTurns(sampler, slots=2, decode_steps=4, chunk=16)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    prompt = list(range(20, 45))
    turns.put([TurnRequest(0, prompt, params)])
    ((_, first),) = turns.take()
    answer = [301, 302, 303, 304, 305]
    context = prompt + first.token_ids + answer
    before = turns.prefilled
    turns.put([TurnRequest(0, context, dataclasses.replace(params, seed=8))])
    ((_, second),) = turns.take()
    assert turns.prefilled - before == len(answer)
    want = sampler.generate([context], dataclasses.replace(params, seed=8))[0]
    assert second.token_ids == want.token_ids
    np.testing.assert_allclose(second.logprobs, want.logprobs, atol=2e-5)

    other = [9, 9, 9, *context[3:]]  # not a continuation: every token prefilled again
    before = turns.prefilled
    turns.put([TurnRequest(0, other, params)])
    turns.take()
    assert turns.prefilled - before == len(other)


def test_new_prompt_shapes_compile_nothing(rollout_model_dir):
    """After one round, rounds of other prompt lengths, counts and turn budgets run the programs already compiled
    (the engines of a run share them)."""
    from rollout.engine_programs import EnginePrograms

    sampler = sampler_for(rollout_model_dir("llama"))
    clock, programs = compile_clock(), EnginePrograms()
    drain(SlotTurns(sampler, slots=4, programs=programs), requests(1))
    before = clock.read()
    for seed in (2, 3):
        drain(SlotTurns(sampler, slots=4, programs=programs), requests(seed)[: 3 + seed])
    waited = clock.read() - before
    assert waited.compiles + waited.cache_hits == 0  # not even loaded from the session's cache


def test_episodes_that_start_from_one_prompt_share_its_prefill(rollout_model_dir):
    """Four episodes of one prompt (a GRPO group) and one of another: each prompt is prefilled once and copied to its
    other episodes' slots, and every episode samples what `generate` samples for it."""
    sampler = sampler_for(rollout_model_dir("qwen2"))
    turns = SlotTurns(sampler, slots=8, decode_steps=4, chunk=16)
    prompt, other = list(range(30, 50)), list(range(60, 71))
    reqs = [TurnRequest(k, prompt, SamplingParams(temperature=1.0, max_tokens=9, seed=k)) for k in range(4)]
    reqs.append(TurnRequest(4, other, SamplingParams(temperature=1.0, max_tokens=9, seed=4)))
    got = drain(turns, reqs, put_at_once=5)
    assert turns.prefilled == len(prompt) + len(other)
    for r in reqs:
        assert got[r.key].token_ids == sampler.generate([r.token_ids], r.params)[0].token_ids, r.key
    assert len({tuple(got[k].token_ids) for k in range(4)}) > 1  # their own seeds: not one completion copied


def test_turns_that_sample_differently_or_do_not_fit_are_refused(rollout_model_dir):
    sampler = sampler_for(rollout_model_dir("llama"), max_model_len=32)
    turns = SlotTurns(sampler, slots=2)
    turns.put([TurnRequest(0, [5, 6], SamplingParams(temperature=1.0, max_tokens=4))])
    with pytest.raises(ValueError, match="sample alike"):
        turns.put([TurnRequest(1, [5, 6], SamplingParams(temperature=0.0, max_tokens=4))])
    with pytest.raises(ValueError, match="max_model_len=32"):
        turns.put([TurnRequest(2, list(range(30)), SamplingParams(temperature=1.0, max_tokens=4))])
