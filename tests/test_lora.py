"""LoRA and QLoRA on the core model: the adapter's maths, what trains, merging, the reference with adapters off,
PEFT's format both ways (against `peft` on the transformers model), starting from an adapter, checkpoints, and the
quantized base."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import LoraConfig, ModelConfig, OptimConfig
from core.errors import CheckpointMismatch
from core.learner import Learner
from core.losses import nll_loss
from core.mesh import single_device_mesh
from core.models import create_model
from core.models.adapters import adapters_off, merged_model
from tests.helpers import recording_sgd

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def tokens(seed=0, shape=(2, 12)):
    return jnp.asarray(np.random.default_rng(seed).integers(1, 128, shape), jnp.int32)


def with_lora(cfg=CFG, **kw) -> ModelConfig:
    return cfg.model_copy(update={"lora": LoraConfig(**{"rank": 4, "alpha": 8.0, **kw})})


def trained_adapters(model, seed=1):
    """`model` with every adapter's A and B set to random values (as after training), in place."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.LoRAParam):
            old = var.get_value()
            var.set_value(jax.device_put(jnp.asarray(rng.normal(0, 0.05, var.shape), var.dtype), old.sharding))
    return model


def f32_steps(want: np.ndarray, n: int) -> float:
    """n float32 steps at the scale of the tensor `want` (its largest magnitude)."""
    return float(n * np.spacing(np.float32(np.abs(want).max())))


def test_the_adapter_adds_scale_x_a_b_to_each_projection():
    """One projection's output with an adapter == the base's + (alpha / r) x A B in NumPy, with A, B random and
    rsLoRA's alpha / sqrt(r); on a `[D, N, H]` kernel (q) and a `[N, H, D]` one (o)."""
    for rslora in (False, True):
        cfg = with_lora(use_rslora=rslora, target_modules=["q_proj", "o_proj"])
        model = trained_adapters(create_model(cfg.model_copy(update={"scan_layers": False}), seed=0))
        attn = model.layers[0].attn
        x = np.random.default_rng(2).normal(size=(2, 5, 64)).astype(np.float32)
        scale = 8.0 / (np.sqrt(4) if rslora else 4)
        q = attn.q_proj
        a, b, w = (np.asarray(v[...], np.float64) for v in (q.lora.a, q.lora.b, q.kernel))
        want = np.einsum("btd,dnh->btnh", x, w) + scale * np.einsum("btd,dr,rnh->btnh", x, a, b)
        np.testing.assert_allclose(np.asarray(q(jnp.asarray(x))), want, rtol=0, atol=f32_steps(want, 16))
        o = attn.o_proj
        xo = np.random.default_rng(3).normal(size=(2, 5, 4, 16)).astype(np.float32)
        a, b, w = (np.asarray(v[...], np.float64) for v in (o.lora.a, o.lora.b, o.kernel))
        want = np.einsum("btnh,nhd->btd", xo, w) + scale * np.einsum("btnh,nhr,rd->btd", xo, a, b)
        np.testing.assert_allclose(np.asarray(o(jnp.asarray(xo))), want, rtol=0, atol=f32_steps(want, 16))
        assert attn.k_proj.lora is None and model.layers[0].mlp.up_proj.lora is None  # only the targets


def test_only_the_adapters_train_and_the_base_gets_no_gradient_or_moments():
    """A LoRA learner's trainable state is its adapters alone (no gradient buffer or optimizer moment for the
    base); one update moves them and leaves every base parameter as it was; at the start (B = 0) the model is
    its base."""
    base = create_model(CFG, seed=0)
    model = create_model(with_lora(), seed=0)
    np.testing.assert_array_equal(np.asarray(model(tokens())), np.asarray(base(tokens())))
    from tests.test_train_step import make_batch, packed

    learner = Learner(model, single_device_mesh(), nll_loss, OptimConfig(name="adamw"), total_updates=2)
    trained = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.params)]
    assert len(trained) == 14 and all(p.endswith(("lora.a", "lora.b")) for p in trained)  # 7 targets x (A, B)
    moments = [leaf for leaf in jax.tree.leaves(learner.state.opt_state) if leaf.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(learner.params))
    before = jax.tree.map(np.asarray, learner.rest)
    batch = packed({**make_batch(rows=4, t=12), "tokens": np.asarray(tokens(1, (4, 12)))})
    update = learner.update(batch, 1)
    assert update.applied and update.grad_norm > 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(learner.rest)):
        np.testing.assert_array_equal(a, np.asarray(b))
    b_after = [np.asarray(x) for p, x in nnx.to_flat_state(learner.params) if p[-1] == "b"]
    assert all(np.abs(x).max() > 0 for x in b_after)  # B left zero


@pytest.mark.parametrize("scan", [True, False])
def test_merged_and_adapters_off_models_compute_what_they_should(scan):
    """`merged_model` (what an export and a merged sync read) gives the adapted model's logits; `adapters_off`
    (the reference) gives the base's, and shares its arrays."""
    cfg = with_lora(CFG.model_copy(update={"scan_layers": scan}), use_rslora=True)
    base = create_model(cfg.model_copy(update={"lora": None}), seed=0)
    model = trained_adapters(create_model(cfg, seed=0))
    x = tokens(3)
    adapted, plain = np.asarray(model(x)), np.asarray(merged_model(model)(x))
    assert np.abs(adapted - np.asarray(base(x))).max() > 1e-2  # the adapters do something
    np.testing.assert_allclose(plain, adapted, rtol=0, atol=32 * np.spacing(np.abs(adapted).max()))
    assert merged_model(model).cfg.lora is None
    off = adapters_off(model)
    np.testing.assert_array_equal(np.asarray(off(x)), np.asarray(base(x)))
    shared = nnx.state(off, nnx.Not(nnx.LoRAParam))
    own = nnx.state(model, nnx.Not(nnx.LoRAParam))
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(own)):
        assert a is b  # the base's arrays themselves: no second copy


def test_dropout_reaches_the_adapter_only_with_a_key():
    cfg = with_lora(dropout=0.5)
    model = trained_adapters(create_model(cfg, seed=0))
    x = tokens(4)
    plain = np.asarray(model.hidden_states(x))
    np.testing.assert_array_equal(np.asarray(model.layer_states(x)[0]), plain)
    dropped = np.asarray(model.layer_states(x, rng=jax.random.key(0))[0])
    again = np.asarray(model.layer_states(x, rng=jax.random.key(0))[0])
    assert np.abs(dropped - plain).max() > 1e-3 and np.array_equal(dropped, again)
    no_dropout = trained_adapters(create_model(with_lora(dropout=0.0), seed=0))
    np.testing.assert_array_equal(
        np.asarray(no_dropout.layer_states(x, rng=jax.random.key(0))[0]), np.asarray(no_dropout.hidden_states(x))
    )


def test_peft_loads_the_exported_adapter_onto_the_transformers_base_with_the_same_logits(tmp_path, tiny_hf_dir):
    """The export's `adapter/` (PEFT's files and key names) loaded by `peft` onto the transformers base gives the
    adapted model's logits (float32, <= 1e-4), and the merged export loaded by transformers gives them too; for a
    Qwen2 base (q/k/v biases) with every target, rsLoRA."""
    import torch
    import transformers
    from peft import PeftModel

    from core.checkpoint_models import initial_model
    from core.config import Config, RunConfig
    from core.learner import ADAPTER_DIR

    base_dir = tiny_hf_dir("qwen2")
    cfg = Config(run=RunConfig(run_dir=str(tmp_path)), model=with_lora(use_rslora=True, alpha=6.0))
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"init_from": str(base_dir)})})
    mesh = single_device_mesh()
    model, cfg = initial_model(cfg, mesh)
    assert cfg.model.lora is not None and cfg.model.family == "qwen2"
    trained_adapters(model)
    learner = Learner(model, mesh, nll_loss, cfg.optim, total_updates=1)
    out = learner.export_hf(tmp_path / "hf", None, init_from=str(base_dir))
    adapter_dir = out / ADAPTER_DIR
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] and config["base_model_name_or_path"] == str(base_dir)
    x = np.random.default_rng(5).integers(1, 500, (2, 10))
    ours = np.asarray(learner.model()(jnp.asarray(x, jnp.int32)))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(torch.tensor(x)).logits.numpy()
        assert np.abs(base_logits - ours).max() > 1e-2  # the adapters change the logits
        peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        theirs = peft_model(torch.tensor(x)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        merged_logits = merged(torch.tensor(x)).logits.numpy()
    assert np.abs(theirs - ours).max() <= 1e-4
    assert np.abs(merged_logits - ours).max() <= 1e-4


def test_a_run_starts_from_a_peft_adapter_and_refuses_one_of_another_shape(tmp_path, tiny_hf_dir):
    """`checkpoint.init_from` a PEFT adapter directory: its base (`base_model_name_or_path`) with its adapters'
    values, the logits `peft` gives; an adapter whose rank or targets differ from `model.lora` is refused naming
    the keys; a directory missing a tensor names it."""
    import torch
    import transformers
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    from core.checkpoint_models import initial_model
    from core.config import CheckpointConfig, Config

    base_dir = tiny_hf_dir("llama")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_cfg = PeftLoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, peft_cfg).eval()  # init_lora_weights=False: B random too
    peft_model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base_dir)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))

    def start(**lora):
        cfg = Config(model=with_lora(**lora), checkpoint=CheckpointConfig(init_from=str(tmp_path / "adapter")))
        return initial_model(cfg, single_device_mesh())

    model, cfg = start(target_modules=["q_proj", "v_proj", "down_proj"])
    x = np.random.default_rng(6).integers(1, 500, (2, 9))
    with torch.no_grad():
        want = peft_model(torch.tensor(x)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(x, jnp.int32))) - want).max() <= 1e-4
    # its export names the adapter's base, not the adapter it started from, and loads there with the same logits
    learner = Learner(model, single_device_mesh(), nll_loss, cfg.optim, total_updates=1)
    exported = learner.export_hf(tmp_path / "hf", None, init_from=str(tmp_path / "adapter")) / "adapter"
    assert json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    reloaded = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(exported)
    ).eval()
    with torch.no_grad():
        assert np.abs(reloaded(torch.tensor(x)).logits.numpy() - want).max() <= 1e-4
    with pytest.raises(CheckpointMismatch, match=r"target_modules: adapter \['q_proj', 'v_proj', 'down_proj'\]"):
        start(target_modules=["q_proj", "v_proj"])
    with pytest.raises(CheckpointMismatch, match=r"rank: adapter 4, model.lora 8"):
        start(rank=8, target_modules=["q_proj", "v_proj", "down_proj"])
    from safetensors.numpy import load_file, save_file

    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    dropped = next(k for k in tensors if "layers.1.mlp.down_proj.lora_B" in k)
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(weights))
    with pytest.raises(CheckpointMismatch, match=rf"missing {dropped}"):
        start(target_modules=["q_proj", "v_proj", "down_proj"])


def test_a_lora_checkpoint_holds_the_adapters_and_loads_back_onto_its_base(tmp_path, tiny_hf_dir):
    """A LoRA run's checkpoint holds its adapters (and their optimizer state), not the base; a later run reading
    it (`checkpoint.init_from` the run) gets the adapted model: its base from the run's own `init_from`."""
    from core.checkpoint import Checkpointer
    from core.checkpoint_models import initial_model, load_model_from
    from core.config import CheckpointConfig, Config
    from tests.helpers import saved_tensors

    base_dir = tiny_hf_dir("llama")
    cfg = Config(model=with_lora(), checkpoint=CheckpointConfig(init_from=str(base_dir)))
    model, cfg = initial_model(cfg, single_device_mesh())
    trained_adapters(model)
    learner = Learner(model, single_device_mesh(), nll_loss, cfg.optim, total_updates=1, tx=recording_sgd(1.0))
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    learner.save(ckpt, cfg)
    saved = saved_tensors(tmp_path / "checkpoints" / "0")
    assert len(saved) == 14 and all(p.endswith(("lora.a", "lora.b")) for p in saved)
    loaded = load_model_from(tmp_path)  # merged: what a run starting from it gets without adapters of its own
    x = tokens(7)
    ours = np.asarray(learner.model()(x))
    np.testing.assert_allclose(np.asarray(loaded(x)), ours, rtol=0, atol=32 * np.spacing(np.abs(ours).max()))
    # the base changed behind the same path: the adapters are not applied to it, the error says so
    import shutil

    from core.tiny import save_tiny_hf_model

    shutil.rmtree(base_dir)
    save_tiny_hf_model(base_dir, "llama", seed=5)
    with pytest.raises(CheckpointMismatch, match="trained beside other frozen weights"):
        load_model_from(tmp_path)


@pytest.mark.parametrize("lora", [False, True])
def test_a_distillation_checkpoint_loads_back_as_its_student(tmp_path, tiny_hf_dir, lora):
    """A distillation run's tree (the student, its feature projections, a teacher) checkpoints the student's
    trainable part and the projections; `load_model_from` on the run reads the student back (from where the tree
    held it; with LoRA, onto its base), with its logits."""
    from core.checkpoint import Checkpointer
    from core.checkpoint_models import initial_model, load_model_from
    from core.config import CheckpointConfig, Config
    from core.models.lora import trainable_filter
    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import DistillModules, DistillSettings, distill_objective, trainable

    base_dir = tiny_hf_dir("llama")
    model_cfg = with_lora() if lora else CFG
    cfg = Config(model=model_cfg, checkpoint=CheckpointConfig(init_from=str(base_dir)))
    mesh = single_device_mesh()
    model, cfg = initial_model(cfg, mesh)
    if lora:
        trained_adapters(model)
    teacher = create_model(cfg.model.model_copy(update={"lora": None, "hidden_size": 96, "head_dim": 24}), seed=3)
    tree = DistillModules(model, feature_projections([(1, 1)], 64, 96, 0), teacher)
    learner = Learner(
        tree,
        mesh,
        distill_objective(DistillSettings(), cfg.model),
        cfg.optim,
        total_updates=1,
        trainable=trainable(trainable_filter(cfg.model)),
    )
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    learner.save(ckpt, cfg)
    ckpt.close()
    x = tokens(9)
    want = np.asarray(learner.model()(x))
    got = np.asarray(load_model_from(tmp_path)(x))
    np.testing.assert_allclose(got, want, rtol=0, atol=32 * np.spacing(np.abs(want).max()))
    # a checkpoint of an earlier Temper (student and projections in two items) is refused by name, not resumed
    (tmp_path / "checkpoints" / "0" / "companion").mkdir()
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    with pytest.raises(CheckpointMismatch, match=r"earlier Temper .* `companion` item"):
        learner.restore_latest(ckpt, cfg)
    ckpt.close()


# The float base's logits against the quantized base's, |delta| max: measured 0.11 (int8) and 1.3 (NF4, blocks of
# 32) on this random model whose logits have std 1 (per weight: 0.6% and 8.4% mean relative error, qwix's own).
@pytest.mark.parametrize("kind, tolerance", [("int8", 0.25), ("nf4", 2.5)])
def test_a_quantized_base_computes_its_dequantized_weights(kind, tolerance):
    """QLoRA: the frozen base stored as int8 or NF4 (qwix's quantization) gives the logits of the same model with
    its kernels dequantized in float32 (the merged model), to float32 rounding; against the original float base
    within the quantization's own error (stated per kind: logits of a random tiny model, |delta| max); and it holds
    1 byte (int8) or half a byte (NF4, two codes a byte) per kernel weight plus its scales."""
    cfg = with_lora(quantize_base=kind, quant_block_size=32)
    float_base = create_model(cfg.model_copy(update={"lora": None}), seed=0)
    model = trained_adapters(create_model(cfg, seed=0))
    x = tokens(8)
    ours = np.asarray(model(x))
    dequantized = np.asarray(merged_model(model)(x))
    np.testing.assert_allclose(ours, dequantized, rtol=0, atol=64 * np.spacing(np.abs(ours).max()))
    off = np.asarray(adapters_off(model)(x))
    assert 1e-4 < np.abs(off - np.asarray(float_base(x))).max() < tolerance
    stored = sum(v.nbytes for _, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    full = sum(v.nbytes for _, v in nnx.to_flat_state(nnx.state(float_base)))
    kernels = sum(
        v.nbytes for p, v in nnx.to_flat_state(nnx.state(float_base)) if p[-1] == "kernel" and "lm_head" not in p
    )
    saving = full - stored
    per_weight = 1.0 if kind == "int8" else 0.5
    assert saving > kernels * (1 - per_weight / 4) * 0.9, (saving, kernels)


@pytest.mark.parametrize(
    "key, value",
    [
        ("bias", "all"),
        ("use_dora", True),
        ("fan_in_fan_out", True),
        ("rank_pattern", {"q_proj": 8}),
        ("modules_to_save", ["lm_head"]),
        ("layers_to_transform", [0]),
        ("target_modules", ["q_proj", "embed_tokens"]),
    ],
)
def test_an_adapter_temper_cannot_hold_is_refused_naming_the_key(tmp_path, key, value):
    """PEFT adapter settings Temper's adapters cannot represent: refused by `read_adapter`, naming file and key
    (an accepted config with the same files loads: the refusal is the key's)."""
    from safetensors.numpy import save_file

    from core.hf.peft import read_adapter

    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": "b",
    }
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert read_adapter(tmp_path).lora.rank == 4
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointMismatch, match=rf"adapter_config.json: {key}="):
        read_adapter(tmp_path)
