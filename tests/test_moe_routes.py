"""Routing replay: the routes the samplers return (JAX, vLLM), replayed in the trainer with the router's own gate
weights, kept exactly through a checkpoint's JSON, and routes that cannot be replayed refused naming the completion."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import ModelConfig
from core.hf.directory import load_hf
from core.kernels.experts import dense_experts
from core.models import create_model
from tests.helpers import with_router_stats
from tests.test_moe_models import moe_config


def test_the_jax_sampler_returns_the_routes_the_trainer_computes(rollout_model_dir):
    """Each token's experts, as the JAX sampler routed it (prompt tokens in the prefill, sampled ones as they were
    fed back), are the trainer's own top-k on the whole sequence: float32, same weights, no token differs."""
    from rollout.jax_sampler import JaxSampler
    from rollout.sampler import SamplingParams

    path = rollout_model_dir("qwen3_moe")
    model, _ = load_hf(path)
    sampler = JaxSampler(model, str(path), max_model_len=128)
    outs = sampler.generate([[5, 17, 99, 3], [7, 8, 9]], SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=0))
    for c in outs:
        seq = c.prompt_ids + c.token_ids
        assert c.routes is not None and c.routes.shape == (len(seq), 2, 2)  # 2 sparse layers, top-2
        assert (c.routes >= 0).all()
        _, stats = with_router_stats(
            lambda m, s=seq, r=c.routes: m.layer_states(np.asarray([s], np.int32), routes=r[None], replay=False), model
        )
        assert float(stats.routed) == len(seq) * 2 and float(stats.differed) == 0.0


def test_replayed_routes_replace_the_routers_choice_with_its_own_gate_weights():
    """With `replay`, a token goes to the sampler's experts, weighted by this router's probabilities at them
    (renormalised): the layer equals the dense reference on those experts and weights; the router still gets a
    gradient; tokens without routes (-1) keep their own; without `replay` the output is the router's own."""
    cfg = moe_config(num_experts=8)
    block = create_model(ModelConfig(**{**cfg.model_dump(), "num_layers": 1, "scan_layers": False}), seed=2)
    layer = block.layers[0].mlp
    x = jax.random.normal(jax.random.key(0), (2, 6, cfg.hidden_size))
    flat = x.reshape(-1, cfg.hidden_size)
    logits, _, own = layer.route(flat)
    routes = (own + 3) % 8  # other experts for every token ...
    routes = routes.at[4].set(-1)  # ... but one, which keeps its own
    y, stats, used = layer(x, routes=routes.reshape(2, 6, 2), replay=True)
    chosen = jnp.where(jnp.arange(12)[:, None] == 4, own, routes)
    assert np.array_equal(np.asarray(used).reshape(12, 2), np.asarray(chosen))
    probs = jax.nn.softmax(logits, axis=-1)
    weights = jnp.take_along_axis(probs, chosen, axis=-1)
    weights = weights / weights.sum(-1, keepdims=True)
    want = dense_experts(flat, weights, chosen, layer.w_gate[...], layer.w_up[...], layer.w_down[...])
    assert np.abs(np.asarray(y).reshape(12, -1) - np.asarray(want)).max() <= 1e-5
    assert float(stats.routed) == 11 and float(stats.differed) == 11
    plain, _, _ = layer(x, routes=routes.reshape(2, 6, 2), replay=False)
    own_y, _, _ = layer(x)
    assert np.array_equal(np.asarray(plain), np.asarray(own_y)) and not np.allclose(np.asarray(y), np.asarray(own_y))
    graphdef, state = nnx.split(layer)

    def total(state):
        return nnx.merge(graphdef, state)(x, None, routes.reshape(2, 6, 2), True)[0].sum()

    assert np.abs(np.asarray(jax.grad(total)(state)["router"][...])).max() > 0


def test_a_vllm_step_s_routes_land_at_their_requests_positions():
    """`scatter_step` (rollout/vllm_routes.py): a pass's flat rows go to the request and position each was computed
    for; a request's buffer grows past its first rows and keeps what it held; padding rows are dropped; positions
    never run stay -1."""
    from rollout.vllm_routes import scatter_step

    store: dict = {}
    prefill = np.arange(7 * 2 * 2).reshape(7, 2, 2)  # request a: 4 prompt tokens; b: 3; one padding row past them
    scatter_step(store, ["a", "b"], np.array([0, 4, 6]), np.array([0, 1, 2, 3, 0, 1, 9]), prefill)
    decode = np.full((2, 2, 2), 7)
    scatter_step(store, ["b", "a"], np.array([0, 1, 2]), np.array([2, 300]), decode)  # a's token 300: a growth
    a, b = store["a"], store["b"]
    assert np.array_equal(a[:4], prefill[:4]) and np.array_equal(a[300], decode[1]) and len(a) >= 301
    assert (a[4:300] == -1).all() and (a[301:] == -1).all()
    assert np.array_equal(b[:2], prefill[4:6]) and np.array_equal(b[2], decode[0]) and (b[3:] == -1).all()


def test_a_completions_routes_survive_a_checkpoints_json_exactly():
    """`Completion.record` / `from_record`, the form in-flight completions take in a checkpoint's JSON: routes
    (-1 included) come back equal, as int32; a completion without routes stays without."""
    from rollout.sampler import Completion

    routes = np.array([[[3, 0], [1, 2]], [[-1, -1], [-1, -1]]], np.int32)
    c = Completion([1, 2], [3], [-0.5], "stop", "x", policy_version=4, routes=routes)
    back = Completion.from_record(json.loads(json.dumps(c.record())))
    assert back.routes is not None and back.routes.dtype == np.int32 and np.array_equal(back.routes, routes)
    assert (back.prompt_ids, back.token_ids, back.policy_version) == ([1, 2], [3], 4)
    plain = Completion([1], [2], None, "length", "")
    assert Completion.from_record(json.loads(json.dumps(plain.record()))).routes is None


def _routed_completions(n: int = 2, layers: int = 2, k: int = 2):
    from rollout.sampler import Completion

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        prompt, tokens = [5, 6, 7], [int(x) for x in rng.integers(3, 60, 4)]
        routes = rng.integers(0, 4, (len(prompt) + len(tokens), layers, k)).astype(np.int32)
        out.append(Completion(prompt, tokens, [-1.0] * len(tokens), "stop", "", routes=routes))
    return out


def test_routes_that_do_not_cover_their_tokens_are_refused_naming_the_completion():
    """A completion's routes must hold one entry a prompt and completion token: short ones are refused (before,
    the packed batch would have replayed the wrong tokens' experts)."""
    import dataclasses

    from posttrain.onpolicy.rl_batch import build_rl_batch

    comps = _routed_completions()
    batch = build_rl_batch(comps, np.ones(2), np.ones(2, bool), row_len=32, max_tokens=8, replay=True)
    assert batch.packed.routes is not None and batch.packed.replay  # whole routes reach the batch
    comps[1] = dataclasses.replace(comps[1], routes=comps[1].routes[:-1])  # one token short
    with pytest.raises(ValueError, match=r"completion 1: routes of shape \(6, 2, 2\) .* \(expected \(7, 2, 2\)\)"):
        build_rl_batch(comps, np.ones(2), np.ones(2, bool), row_len=32, max_tokens=8, replay=True)


def test_a_replayed_batch_without_routes_is_refused():
    """Replay with a completion that came without routes is refused, counting them; without replay the batch is
    built without routes (nothing to compare)."""
    import dataclasses

    from posttrain.onpolicy.rl_batch import build_rl_batch

    comps = _routed_completions()
    comps[0] = dataclasses.replace(comps[0], routes=None)
    with pytest.raises(ValueError, match="rl.router_replay=replay, but 1 of 2 completions came without routes"):
        build_rl_batch(comps, np.ones(2), np.ones(2, bool), row_len=32, max_tokens=8, replay=True)
    assert build_rl_batch(comps, np.ones(2), np.ones(2, bool), row_len=32, max_tokens=8).packed.routes is None


def test_pi_old_replays_the_samplers_routes_as_the_update_does():
    """GRPO with several updates a step (`rl.batch.num_iterations=2`) and routing replay: pi_old, attached before the
    first update, is the policy's log-probs on the sampler's routes (what the update's own forward pass computes),
    not on its routers' own choice, so the first update's ratio is 1 where the weights have not moved. The
    sampler's routes are every token's own experts + 1, so the two differ; the frozen reference still routes as its
    own routers do."""
    from core.config_loader import load_config
    from core.mesh import single_device_mesh
    from core.method_learner import MethodLearner
    from core.targets import target_logprobs
    from posttrain.config import PostTrainConfig
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.rl_batch import build_rl_batch
    from rollout.sampler import Completion
    from tests.test_moe_methods import QWEN3_MOE

    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [*QWEN3_MOE, "rl.router_replay=replay", "rl.batch.num_iterations=2", "rl.loss.beta=0.1", "train.steps=2"],
        schema=PostTrainConfig,
    )
    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model = create_model(cfg.model, mesh, seed=0)
    learner = MethodLearner(cfg, GRPO, model, mesh)
    rng = np.random.default_rng(0)
    comps = []
    for _ in range(8):
        prompt, tokens = [int(x) for x in rng.integers(3, 500, 4)], [int(x) for x in rng.integers(3, 500, 5)]
        comps.append(Completion(prompt, tokens, [-3.0] * 5, "stop", ""))
    # every token's routes: experts (i + 1, i + 2) mod 4 at every sparse layer, never all the router's own
    sparse = sum(cfg.model.sparse_layers)
    for i, c in enumerate(comps):
        n = len(c.prompt_ids) + len(c.token_ids)
        c.routes = ((np.arange(n)[:, None, None] + i + np.arange(1, 3)[None, None, :]) % 4).repeat(sparse, 1)
        c.routes = c.routes.astype(np.int32)
    batch = build_rl_batch(comps, rng.normal(size=8), np.ones(8, bool), row_len=32, max_tokens=8, groups=1, replay=True)
    attached, _ = learner.attach(batch)
    targets = np.asarray(batch.packed.target_mask) > 0
    # the policy's own pass reads the batch's routes (routed=True); any other pass on the same batch does not
    replayed = np.asarray(target_logprobs(model, batch.packed, 1.0, entropy=False, routed=True)[0])
    own = np.asarray(target_logprobs(model, batch.packed, 1.0, entropy=False)[0])
    assert np.abs(replayed - own)[targets].max() > 1e-3  # the routes change the log-probs: the check can fail
    np.testing.assert_allclose(np.asarray(attached.old_logp)[targets], replayed[targets], atol=1e-5)
    np.testing.assert_allclose(np.asarray(attached.ref_logp)[targets], own[targets], atol=1e-5)
