"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, their HF checkpoints both ways, their router
terms in the training loss, and the configs and checkpoints they refuse."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from pydantic import ValidationError
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from core.config import MeshConfig, ModelConfig, MoeConfig
from core.errors import CheckpointMismatch
from core.hf.config import UnsupportedHFConfig
from core.hf.directory import load_hf, save_hf
from core.kernels.experts import dense_experts
from core.losses import nll_loss
from core.mesh import make_mesh
from core.models import ModuleTree, create_model
from core.optim import make_optimizer
from core.router_loss import RouterSown, capture_router, sown_at
from core.sums import to_host
from core.tiny import save_tiny_hf_model
from core.train import bind_loss, init_train_state, jit_train_step, make_train_step, split_micro_batches, split_modules
from tests.helpers import with_router_stats
from tests.test_train_step import SGD, make_batch, packed

TOL = 1e-4  # the bound on float32 logits

# Configs the model code was not tuned to: sparse every other layer, a dense layer by index, top-k weights left
# unnormalised and renormalised, tied and untied embeddings, top-1 and top-3.
CONFIGS = {
    "qwen3_moe": dict(),
    "qwen3_moe, sparse_step 2, unnormalised": dict(decoder_sparse_step=2, num_hidden_layers=3, norm_topk_prob=False),
    "qwen3_moe, mlp_only_layers, tied": dict(mlp_only_layers=[0], tie_word_embeddings=True, num_experts_per_tok=3),
    "mixtral": dict(),
    "mixtral, tied, top-1": dict(tie_word_embeddings=True, num_experts_per_tok=1),
    # Qwen2-MoE: a gated shared expert beside the routed ones, q/k/v biases on and off
    "qwen2_moe": dict(),
    "qwen2_moe, sparse_step 2, normalised, no qkv bias, tied": dict(
        decoder_sparse_step=2, num_hidden_layers=3, norm_topk_prob=True, qkv_bias=False, tie_word_embeddings=True
    ),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cache: dict = {}

    def make(name: str):
        if name not in cache:
            family = name.split(",")[0]
            cache[name] = save_tiny_hf_model(tmp_path_factory.mktemp("moe"), family, seed=3, **CONFIGS[name])
        return cache[name]

    return make


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(moe_dir, name):
    path = moe_dir(name)
    hf = hf_model(path)
    tokens = np.random.RandomState(1).randint(0, 512, (2, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    model, cfg = load_hf(path)
    # The layers transformers made sparse are the ones Temper did.
    hf_sparse = tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers)
    assert cfg.sparse_layers == hf_sparse and any(hf_sparse)
    assert cfg.scan_layers == (len(set(hf_sparse)) == 1)
    out = np.asarray(model(tokens.astype(np.int32)))
    assert np.abs(out - ref).max() <= TOL


@pytest.mark.parametrize("name", ["qwen2_moe"])  # the routed and the shared expert
def test_scanned_and_listed_layers_agree(moe_dir, name):
    tokens = np.random.RandomState(2).randint(0, 512, (2, 16)).astype(np.int32)
    scanned, _ = load_hf(moe_dir(name))
    listed, cfg = load_hf(moe_dir(name), scan_layers=False)
    assert not cfg.scan_layers
    assert np.abs(np.asarray(scanned(tokens)) - np.asarray(listed(tokens))).max() <= 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe, mlp_only_layers, tied", "mixtral", "qwen2_moe"])
def test_export_writes_the_checkpoint_transformers_wrote(moe_dir, tmp_path, name):
    src = moe_dir(name)
    model, cfg = load_hf(src)
    out = save_hf(model, cfg, tmp_path / "out")
    with safe_open(str(src / "model.safetensors"), "np") as a, safe_open(str(out / "model.safetensors"), "np") as b:
        names = sorted(a.keys())
        assert sorted(b.keys()) == names
        assert any(".experts.3." in n for n in names)
        for n in names:
            assert np.array_equal(a.get_tensor(n), b.get_tensor(n)), n
    written = json.loads((out / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    keys = ("num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size")
    for key in (*keys, "shared_expert_intermediate_size", "qkv_bias"):
        assert written.get(key) == original.get(key), key
    tokens = torch.tensor(np.random.RandomState(3).randint(0, 512, (1, 12)))
    with torch.no_grad():
        assert torch.equal(hf_model(out)(tokens).logits, hf_model(src)(tokens).logits)


def test_router_terms_equal_transformers_aux_loss_over_real_tokens(moe_dir):
    """The load-balancing loss over the unpadded tokens is transformers' `aux_loss` with the attention mask; the
    z-loss is the masked mean of logsumexp(router logits)^2 over the sparse layers."""
    path = moe_dir("qwen3_moe, sparse_step 2, unnormalised")
    hf = hf_model(path)
    tokens = np.random.RandomState(4).randint(3, 512, (3, 18))
    mask = np.array([[1] * n + [0] * (18 - n) for n in (18, 11, 5)])
    with torch.no_grad():
        out = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
    model, _ = load_hf(path)
    _, stats = with_router_stats(lambda m: m(tokens.astype(np.int32), segment_ids=mask.astype(np.int32)), model)
    assert stats is not None
    assert float(stats.tokens) == mask.sum() * 1  # one sparse layer of three
    assert abs(float(stats.load_balance_loss()) - float(out.aux_loss)) <= 1e-5
    logits = np.concatenate([r.numpy() for r in out.router_logits])  # [tokens * sparse layers, E]
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    z = (lse**2 * mask.reshape(-1)).sum() / mask.sum()
    assert abs(float(stats.z_loss()) - z) <= 1e-5 * z


def test_compacted_rows_route_and_count_like_the_rows(moe_dir):
    """Running the position-wise layers on the real tokens only (`compact`) changes neither the outputs nor the
    router's counts: the compact list's filler entries are not counted."""
    model, _ = load_hf(moe_dir("mixtral"))
    rows = make_batch(rows=4, t=20, seed=5)
    seg = rows["segment_ids"]
    real = int((seg > 0).sum())
    results = []
    for compact in (0, real + 3):
        (h, _), stats = with_router_stats(
            lambda m, n=compact: m.layer_states(rows["tokens"], rows["positions"], seg, compact=n), model
        )
        results.append((np.asarray(h), stats))
    (h0, s0), (h1, s1) = results
    assert np.abs((h0 - h1)[seg > 0]).max() <= 1e-5
    assert float(s0.tokens) == float(s1.tokens) == real * 2  # two sparse layers
    np.testing.assert_allclose(np.asarray(s0.counts), np.asarray(s1.counts))
    np.testing.assert_allclose(np.asarray(s0.probs), np.asarray(s1.probs), rtol=1e-5)


def moe_config(**moe):
    return ModelConfig(
        family="qwen3_moe", qk_norm=True, moe=MoeConfig(**{"num_experts": 4, "experts_per_token": 2, **moe})
    )


def test_the_train_step_adds_the_weighted_router_terms_and_reports_them():
    """`core.train` adds weight x term x denominator of each router term to a method's loss (here the next-token
    loss), and the step reports the terms and the experts' load."""
    batch = packed(make_batch(rows=4, t=20, seed=6))
    totals = {}
    for weights in [(0.0, 0.0), (0.5, 0.0), (0.0, 0.25)]:
        model = create_model(moe_config(load_balance_weight=weights[0], router_z_loss_weight=weights[1]), seed=0)
        graphdef, params, rest = split_modules(model, nnx.Param)
        bound = bind_loss(graphdef, nll_loss)
        out = bound(params, rest, batch, None)
        plain, stats = with_router_stats(lambda m: nll_loss(m, batch, None), model)
        terms = weights[0] * stats.load_balance_loss() + weights[1] * stats.z_loss()
        expected = plain.total + terms * plain.denominator
        assert abs(float(out.total) - float(expected)) <= 1e-4 * abs(float(expected))
        assert out.router is not None and float(out.router.tokens) == float(stats.tokens) > 0
        totals[weights] = float(out.total)
    assert totals[(0.5, 0.0)] > totals[(0.0, 0.0)] and totals[(0.0, 0.25)] > totals[(0.0, 0.0)]

    graphdef, params, rest = split_modules(create_model(moe_config(load_balance_weight=0.5), seed=0), nnx.Param)
    tx = make_optimizer(SGD, 10, params)
    state = init_train_state(params, tx, seed=0)
    router_before = np.asarray(params["layers"]["mlp"]["router"][...])
    state, update = jit_train_step(make_train_step(graphdef, nll_loss, tx), state)(
        state, split_micro_batches(batch, 1), rest
    )
    metrics = to_host(jax.device_get(update)).metrics()
    assert update.applied and update.grad_norm > 0
    assert not np.array_equal(np.asarray(state.params["layers"]["mlp"]["router"][...]), router_before)
    k = 2  # at perfect balance the term is k (the assignment shares sum to k, the mean probabilities to 1)
    assert 0.5 * k < metrics["moe/load_balance_loss"] < 2 * k
    assert metrics["moe/expert_load_max"] >= 1.0 >= metrics["moe/expert_load_min"] and metrics["moe/z_loss"] > 0


class _WithTeacher(ModuleTree):
    def __init__(self, model, teacher):
        super().__init__(model)
        self.teacher = teacher


def test_a_frozen_moe_model_in_the_tree_adds_nothing():
    """A teacher (or reference) MoE model that the loss also runs records its routers; only the trained model's
    terms reach the loss."""
    cfg = moe_config(load_balance_weight=1.0)
    tree = _WithTeacher(create_model(cfg, seed=0), create_model(cfg, seed=1))
    batch = packed(make_batch(rows=4, t=20, seed=7))

    def loss(modules, b, rng):
        nll_loss(modules.teacher, b, None)  # the frozen model's pass, recorded and left out
        return nll_loss(modules.model, b, rng)

    graphdef, params, rest = split_modules(tree, nnx.Param)
    out = bind_loss(graphdef, loss)(params, rest, batch, None)
    plain, stats = with_router_stats(lambda m: nll_loss(m, batch, None), tree.model)
    expected = plain.total + stats.load_balance_loss() * plain.denominator
    assert abs(float(out.total) - float(expected)) <= 1e-5 * abs(float(expected))
    _, sown = capture_router(loss)(tree, batch, None)  # the teacher did sow: leaving it out is a choice made
    teacher = sown_at(sown, ["teacher"])
    assert teacher is not None and float(teacher.load_balance_loss()) != float(stats.load_balance_loss())


def test_a_forward_pass_outside_a_capture_keeps_nothing_on_the_model():
    """Generation and frozen passes run the model outside any loss: its routers' stats are dropped, not stored on
    the module (Flax's sow would add a variable to its state, and Flax warns of it)."""
    import warnings

    model = create_model(moe_config(), seed=0)
    before = jax.tree.structure(nnx.state(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Flax's deprecation of a sow outside nnx.capture
        model(np.ones((1, 6), np.int32))
    assert jax.tree.structure(nnx.state(model)) == before
    assert not jax.tree.leaves(nnx.state(model, RouterSown))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(family="qwen3_moe"), "model.moe is unset"),
        (dict(family="qwen3", moe=dict(num_experts=4)), "model.moe is set"),
        (dict(family="qwen3_moe", moe=dict(num_experts=4, experts_per_token=5)), "experts_per_token (5)"),
        (dict(family="qwen3_moe", moe=dict(dense_layers=[7])), "dense_layers [7]"),
        (dict(family="qwen3_moe", moe=dict(dense_layers=[0])), "set model.scan_layers=false"),
        (dict(family="mixtral", scan_layers=False, moe=dict(sparse_step=2)), "every Mixtral layer is sparse"),
        (dict(family="qwen3_moe", moe=dict(), lora=dict()), "model.lora on a mixture-of-experts"),
        (dict(family="qwen3_moe", moe=dict(num_experts=1, experts_per_token=1)), "moe.num_experts"),
    ],
)
def test_configs_that_cannot_be_built_are_refused(kwargs, words):
    with pytest.raises(ValidationError) as err:
        ModelConfig(**kwargs)
    assert words in str(err.value)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
        (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        (dict(num_experts=1, num_experts_per_tok=1), "num_experts"),
    ],
)
def test_hf_configs_the_code_cannot_serve_are_refused(moe_dir, tmp_path, change, words):
    src = moe_dir("mixtral" if "router_jitter_noise" in change else "qwen3_moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(UnsupportedHFConfig, match=words):
        load_hf(tmp_path)


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(moe_dir, tmp_path):
    from safetensors.numpy import save_file

    src = moe_dir("qwen3_moe")
    with safe_open(str(src / "model.safetensors"), "np") as f:
        names = [k for k in f.keys() if k != "model.layers.1.mlp.experts.2.up_proj.weight"]  # noqa: SIM118
        tensors = {k: f.get_tensor(k) for k in names}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointMismatch, match=r"missing \(1\): model.layers.1.mlp.experts.2.up_proj.weight"):
        load_hf(tmp_path)


# ---------------------------------------------------------------- expert parallelism


# (expert 4 x tensor 2, the experts' width split too, spans two processes in tests/test_distributed.py)
@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=2, expert=4)], ids=["fsdp2-expert4"])
def test_expert_parallel_steps_equal_one_device(mesh_cfg, monkeypatch):
    """A train step (the router terms on) with the experts split over the `expert` axis
    takes the single-device step: the same loss and parameters within float32 noise. The experts are sharded on
    that axis and the layer really exchanges tokens (`expert_parallel` ran, with the axis's tokens)."""
    from core.models import moe
    from tests.test_train_step import max_param_diff, run_steps

    cfg = ModelConfig(family="qwen3_moe", qk_norm=True, moe=MoeConfig(num_experts=8, load_balance_weight=0.1))
    batches = [make_batch(seed=0)]
    one, m1 = run_steps(cfg, batches, 1)
    calls = []
    original = moe.expert_parallel

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        if out is not None:  # the tokens split over the expert axis and were exchanged
            calls.append(args[0].shape)
        return out

    monkeypatch.setattr(moe, "expert_parallel", spy)
    mesh = make_mesh(mesh_cfg)
    many, m2 = run_steps(cfg, batches, 1, mesh)  # 8 rows: split over every mesh's batch axes
    assert calls, "the expert-parallel layer did not run"
    assert tuple(many.params["layers"]["mlp"]["w_gate"][...].sharding.spec)[:2] == (None, "expert")
    for a, b in zip(m1, m2, strict=True):
        assert a.applied and b.applied and float(b.grad_norm) > 0
        assert abs(float(a.loss) - float(b.loss)) <= 8 * np.finfo(np.float32).eps * max(1.0, abs(float(a.loss)))
    assert max_param_diff(one, many) <= 1e-5


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    cfg = ModelConfig(family="mixtral", moe=MoeConfig(num_experts=6))
    with pytest.raises(ValueError, match=r"mesh.expert \(4\) does not divide the 6 experts"):
        create_model(cfg, make_mesh(MeshConfig(fsdp=2, expert=4)))


@pytest.mark.parametrize("kernel", ["tiled", "capacity"])
def test_a_capacity_factor_drops_past_each_experts_capacity_counting_real_tokens_only(kernel):
    """`model.moe.capacity_factor` 0.5: each expert keeps its first assignments of real tokens, in token order (the
    NumPy walk of tests/test_moe_kernel.py), and the layer equals the dense reference with the others weighing 0;
    padding takes no capacity; the stats count the dropped assignments (`moe/dropped`). A factor no routing can
    exceed gives the dropless layer's output on the real tokens."""
    from core.kernels.experts import expert_capacity
    from core.router_loss import router_metrics
    from tests.test_moe_kernel import numpy_within_capacity

    def layer_of(**moe):
        cfg = moe_config(num_experts=8, **moe)
        return create_model(ModelConfig(**{**cfg.model_dump(), "num_layers": 1, "scan_layers": False}), seed=2)

    layer = layer_of(capacity_factor=0.5, kernel=kernel).layers[0].mlp
    x = jax.random.normal(jax.random.key(0), (2, 12, layer.router.shape[0]))
    valid = jnp.ones((2, 12), bool).at[0, :4].set(False)  # 4 padding tokens first in token order
    y, stats, _ = layer(x, valid)
    flat = x.reshape(24, -1)
    _, weights, chosen = layer.route(flat)
    real = np.asarray(valid).reshape(-1)
    kept = numpy_within_capacity(np.where(real[:, None], np.asarray(chosen), 8), 8, expert_capacity(24, 2, 8, 0.5))
    want = dense_experts(
        flat, jnp.where(kept, weights, 0.0), chosen, layer.w_gate[...], layer.w_up[...], layer.w_down[...]
    )
    assert np.abs(np.asarray(y).reshape(24, -1)[real] - np.asarray(want)[real]).max() <= 1e-5
    dropped = int((real[:, None] & ~kept).sum())
    assert dropped > 0 and float(stats.dropped) == dropped
    assert router_metrics(stats)["moe/dropped"] == pytest.approx(dropped / (20 * 2))
    dropless = layer_of().layers[0].mlp
    roomy = layer_of(capacity_factor=4.0, kernel=kernel).layers[0].mlp  # 24 an expert: every assignment fits
    y_free, free_stats, _ = dropless(x, valid)
    y_roomy, roomy_stats, _ = roomy(x, valid)
    gap = np.abs(np.asarray(y_roomy) - np.asarray(y_free)).reshape(24, -1)
    assert gap[real].max() <= 1e-6 and float(roomy_stats.dropped) == 0  # (padding is not computed: it reads 0)
    assert float(free_stats.dropped) == 0 and router_metrics(free_stats)["moe/dropped"] == 0.0


def test_the_rounds_kernel_in_a_layer_equals_the_tiled_one_with_padding_and_gradients():
    """`model.moe.kernel: rounds` inside an MoE layer (padding tokens masked out, dropless): the tiled layer's output
    on the real tokens, and the same gradients for the router's and the experts' weights (non-zero)."""

    def layer_of(kernel):
        cfg = moe_config(num_experts=8, kernel=kernel)
        return create_model(ModelConfig(**{**cfg.model_dump(), "num_layers": 1, "scan_layers": False}), seed=2)

    x = jax.random.normal(jax.random.key(0), (2, 12, layer_of("tiled").layers[0].mlp.router.shape[0]))
    valid = jnp.ones((2, 12), bool).at[0, :4].set(False)
    real = np.asarray(valid)

    def run(kernel):
        graphdef, state = nnx.split(layer_of(kernel).layers[0].mlp)

        def loss(state):
            y, stats, _ = nnx.merge(graphdef, state)(x, valid)
            return (jnp.where(valid[..., None], y, 0.0) ** 2).sum(), (y, stats)

        (_, (y, stats)), grads = jax.value_and_grad(loss, has_aux=True)(state)
        return np.asarray(y), stats, [np.asarray(g) for g in jax.tree.leaves(grads)]  # router and experts

    y_rounds, stats, g_rounds = run("rounds")
    y_tiled, _, g_tiled = run("tiled")
    assert float(stats.dropped) == 0
    np.testing.assert_allclose(y_rounds[real], y_tiled[real], rtol=1e-5, atol=1e-5)
    assert len(g_rounds) >= 4
    for a, b in zip(g_rounds, g_tiled, strict=True):
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
