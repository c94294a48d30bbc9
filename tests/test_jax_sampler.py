"""The native JAX sampler: greedy == transformers, sampled log-probs == the core model's, seeds, stops, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.config import MeshConfig
from core.hf.directory import load_hf
from core.mesh import make_mesh
from rollout.jax_sampler import JaxSampler
from rollout.sampler import SamplingParams

PROMPTS = [[5, 17, 99, 3], [7, 8, 9, 10, 11, 12, 13], [42]]


def hf_greedy(path, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def sampler_for(path, mesh=None, **kw):
    model, _ = load_hf(path, mesh=mesh)
    return JaxSampler(model, str(path), mesh=mesh, max_model_len=128, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_matches_transformers(rollout_model_dir, family):
    path = rollout_model_dir(family)
    outs = sampler_for(path).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(path, prompt, 12)
        assert out.token_ids == ref
        assert out.prompt_ids == prompt and out.finish_reason == ("stop" if len(ref) < 12 else "length")


def test_tensor_parallel_sampler_matches_single_device(rollout_model_dir):
    path = rollout_model_dir("qwen2")
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=2), jax.devices()[4:6])
    params = SamplingParams(temperature=0.0, max_tokens=10)
    tp = sampler_for(path, mesh).generate(PROMPTS, params)
    single = sampler_for(path).generate(PROMPTS, params)
    assert [c.token_ids for c in tp] == [c.token_ids for c in single]
    np.testing.assert_allclose([c.logprobs for c in tp], [c.logprobs for c in single], atol=1e-5)


def core_logprobs(model, prompt, completion, temperature):
    tokens = jnp.asarray([prompt + completion], jnp.int32)
    logits = model(tokens)[0, len(prompt) - 1 : -1] / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(completion)[:, None], axis=-1)[:, 0])


def test_sampled_logprobs_match_core_model(rollout_model_dir):
    path = rollout_model_dir("llama")
    model, _ = load_hf(path)
    sampler = JaxSampler(model, str(path), max_model_len=128)
    outs = sampler.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=16, seed=3))
    diffs = np.concatenate(
        [np.abs(np.asarray(c.logprobs) - core_logprobs(model, c.prompt_ids, c.token_ids, 0.7)) for c in outs]
    )
    print(f"JAX sampler vs core log-probs at T=0.7: mean {diffs.mean():.2e}, max {diffs.max():.2e}")
    assert diffs.max() < 1e-4


def test_seeds_topk_topp_and_stops(rollout_model_dir):
    sampler = sampler_for(rollout_model_dir("llama"))
    a = sampler.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    b = sampler.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    c = sampler.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=2))
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]
    # top_k=1 is greedy whatever the temperature, and its log-probs are 0 (a one-token distribution)
    k1 = sampler.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, seed=5))
    greedy = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    assert [x.token_ids for x in k1] == [x.token_ids for x in greedy]
    # n samples decode from copies of their prompt's prefill: prompt-major rows, each its prompt's continuation
    greedy3 = sampler.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=8))
    assert [x.token_ids for x in greedy3] == [x.token_ids for x in greedy for _ in range(3)]
    sampled3 = sampler.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1))
    assert all(len({tuple(x.token_ids) for x in sampled3[i : i + 3]}) > 1 for i in range(0, len(sampled3), 3))
    assert np.allclose([x.logprobs for x in k1], 0.0)
    # a tiny top_p also keeps only the most likely token
    p = sampler.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, seed=5))
    assert [x.token_ids for x in p] == [x.token_ids for x in greedy]
    # stop token ids end a completion early, with the stop token included
    first = greedy[0].token_ids
    s = sampler.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first[2],)))[0]
    assert s.token_ids == first[:3] and s.finish_reason == "stop"


def test_update_weights_equals_fresh_sampler(rollout_model_dir):
    a, b = rollout_model_dir("llama", seed=0), rollout_model_dir("llama", seed=1)
    sampler = sampler_for(a)
    new_model, _ = load_hf(b)
    from flax import nnx

    sampler.update_weights(nnx.state(new_model))
    assert sampler.policy_version == 1
    params = SamplingParams(temperature=0.0, max_tokens=12)
    got = sampler.generate(PROMPTS, params)
    want = sampler_for(b).generate(PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]
    assert all(c.policy_version == 1 for c in got)


def test_shorter_prompts_reuse_the_compiled_shape(rollout_model_dir):
    """After a batch of long prompts, short ones run in the same compiled shape (padded further) and give
    what a fresh sampler gives them in its own smaller shape."""
    from rollout.jax_sampler import _generate

    path = rollout_model_dir("llama")
    sampler, params = sampler_for(path), SamplingParams(temperature=0.0, max_tokens=6)
    short = [p[:4] for p in PROMPTS]  # at most 4 tokens: length bucket 8
    sampler.generate([p * 2 for p in PROMPTS], params)  # up to 14 tokens: length bucket 16
    compiled = _generate._cache_size()
    got = sampler.generate(short, params)
    assert _generate._cache_size() == compiled  # 16 <= 2 x bucket 8: reused, nothing compiled
    want = sampler_for(path).generate(short, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    np.testing.assert_allclose(
        np.concatenate([c.logprobs for c in got]), np.concatenate([c.logprobs for c in want]), atol=1e-5
    )


def test_bad_input(rollout_model_dir):
    from flax import nnx

    sampler = sampler_for(rollout_model_dir("llama"))
    with pytest.raises(ValueError, match="empty prompt list"):
        sampler.generate([], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt 1 has 120 tokens.*max_model_len=128"):
        sampler.generate([[1, 2], [3] * 120], SamplingParams(max_tokens=16))
    before = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    state = nnx.state(load_hf(rollout_model_dir("llama", seed=1), scan_layers=False)[0])
    with pytest.raises(ValueError, match="keeping the previous weights"):
        sampler.update_weights(state)
    after = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    assert [c.token_ids for c in before] == [c.token_ids for c in after] and sampler.policy_version == 0


def test_decode_cli(rollout_model_dir, capsys):
    from recipes.decode import main

    assert (
        main(
            [
                str(rollout_model_dir("llama")),
                "--prompt",
                "Calculate 1 + 2.",
                "--prompt",
                "Calculate 3 + 4.",
                "--max-tokens",
                "5",
                "--n",
                "2",
                "--temperature",
                "0.9",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[1.1] (" in out and "tokens/s (jax sampler)" in out


# ------------------------------------------------- processed log-probs vs an independent reference


def np_processed_logp(logits, temperature, top_k, top_p):
    """NumPy, from the definitions: temperature, then keep the top_k logits, then the smallest set of the most
    likely remaining tokens whose probability reaches top_p; log-softmax over what is kept (-inf elsewhere)."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones_like(x, bool)
    if top_k > 0:
        keep &= x >= np.sort(x)[-top_k]
    probs = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    in_p = np.zeros_like(keep)
    in_p[order] = mass_before < top_p
    keep &= in_p
    out = np.full_like(x, -np.inf)
    out[keep] = x[keep] - np.log(np.exp(x[keep] - x[keep].max()).sum()) - x[keep].max()
    return out


def hf_logits(path, ids):
    """[len(ids), V] float64 logits from transformers (an implementation independent of the core model)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def check_processed_logprobs(path, completions, temperature, top_k, top_p):
    """Every sampled token lies in the reference's kept set and carries its processed log-prob; returns how
    many of the steps had top-p cut into the top-k set (so the test can assert that the branch ran)."""
    cut_by_p, gaps = 0, []
    for c in completions:
        logits = hf_logits(path, c.prompt_ids + c.token_ids)
        for j, tok in enumerate(c.token_ids):
            ref = np_processed_logp(logits[len(c.prompt_ids) - 1 + j], temperature, top_k, top_p)
            assert np.isfinite(ref[tok]), (c.token_ids, j)  # sampled from inside the kept set
            gaps.append(abs(c.logprobs[j] - ref[tok]))
            cut_by_p += int(np.isfinite(ref).sum() < min(top_k, len(ref)))
    assert max(gaps) < 1e-4, max(gaps)
    return cut_by_p


def test_top_k_top_p_logprobs_match_a_numpy_reference(rollout_model_dir):
    path = rollout_model_dir("llama")
    outs = sampler_for(path).generate(
        PROMPTS, SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.7, max_tokens=8, seed=4)
    )
    assert check_processed_logprobs(path, outs, 0.9, 20, 0.7) > 0


def test_seeds_are_per_sample_and_independent_of_the_batch(rollout_model_dir):
    """Each sample has its own stream (sample_seed(seed, prompt index, sample index)): the same prompt twice in
    one request gives different samples, the same request gives the same samples again, and a prompt's
    samples do not depend on what else is in the batch, given its index in the request (`prompt_offset`)."""
    sampler = sampler_for(rollout_model_dir("llama"))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11)
    twice = sampler.generate([PROMPTS[0], PROMPTS[0]], params)
    assert len({tuple(c.token_ids) for c in twice}) == 4
    assert [c.token_ids for c in sampler.generate([PROMPTS[0], PROMPTS[0]], params)] == [c.token_ids for c in twice]
    whole = sampler.generate(PROMPTS, params)
    alone = sampler.generate([PROMPTS[2]], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11, prompt_offset=2))
    assert [c.token_ids for c in alone] == [c.token_ids for c in whole[4:6]]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_model_decodes_greedily_as_transformers(rollout_model_dir, family):
    path = rollout_model_dir(family)
    outs = sampler_for(path).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(path, prompt, 12)
