"""HF -> core -> save_hf -> transformers, and clear errors for mismatched checkpoints."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from core.config import ModelConfig
from core.hf.config import UnsupportedHFConfig
from core.hf.directory import CheckpointMismatch, load_hf, save_hf
from core.models import create_model


def logits_of(path, tokens):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", True), ("mistral", False)])
@pytest.mark.parametrize("scan", [True, False])
def test_round_trip_through_transformers(tiny_hf_dir, tmp_path, family, tied, scan):
    src = tiny_hf_dir(family, tied)
    model, cfg = load_hf(src, scan_layers=scan)
    out = save_hf(model, cfg, tmp_path / "export")
    tokens = np.random.RandomState(0).randint(0, 512, (2, 24))
    np.testing.assert_allclose(logits_of(out, tokens), logits_of(src, tokens), atol=1e-5)
    # and the exported tensors are exactly the source tensors
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_fresh_core_model_exports_and_loads_back(tmp_path):
    cfg = ModelConfig(family="qwen3", head_dim=32, qk_norm=True, tie_word_embeddings=True)
    model = create_model(cfg, seed=3)
    out = save_hf(model, cfg, tmp_path / "fresh")
    tokens = np.random.RandomState(1).randint(0, 512, (1, 16))
    np.testing.assert_allclose(logits_of(out, tokens), np.asarray(model(tokens.astype(np.int32))), atol=1e-4)
    again, cfg2 = load_hf(out)
    assert cfg2.family == "qwen3" and cfg2.head_dim == 32
    np.testing.assert_array_equal(
        np.asarray(again(tokens.astype(np.int32))), np.asarray(model(tokens.astype(np.int32)))
    )


def test_sharded_safetensors_with_index(tiny_hf_dir, tmp_path):
    model, cfg = load_hf(tiny_hf_dir("llama"))
    out = save_hf(model, cfg, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = np.random.RandomState(2).randint(0, 512, (1, 12))
    np.testing.assert_allclose(logits_of(out, tokens), logits_of(tiny_hf_dir("llama"), tokens), atol=1e-5)
    again, _ = load_hf(out)
    np.testing.assert_array_equal(
        np.asarray(again(tokens.astype(np.int32))), np.asarray(model(tokens.astype(np.int32)))
    )


def test_bfloat16_export(tiny_hf_dir, tmp_path):
    model, cfg = load_hf(tiny_hf_dir("qwen2"), dtype="bfloat16")
    out = save_hf(model, cfg, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16


def _corrupt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_unexpected_and_misshaped_tensors_listed_by_name(tiny_hf_dir, tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    bad = _corrupt(tiny_hf_dir("llama"), tmp_path / "bad", edit)
    with pytest.raises(CheckpointMismatch) as e:
        load_hf(bad)
    msg = str(e.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected (1): model.layers.0.extra.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected (32, 64), got (8, 64)" in msg


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedHFConfig, match="gpt2"):
        load_hf(tmp_path)


def test_missing_weights(tmp_path, tiny_hf_dir):
    (tmp_path / "config.json").write_text((tiny_hf_dir("llama") / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(tmp_path)


def test_rope_parameters_and_legacy_rope_scaling_read_alike(tiny_hf_dir, tmp_path):
    src = tiny_hf_dir("llama")
    hf = json.loads((src / "config.json").read_text())
    assert "rope_parameters" in hf  # transformers 5 form
    legacy = dict(hf)
    params = legacy.pop("rope_parameters")
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    _, new_cfg = load_hf(src)
    _, old_cfg = load_hf(tmp_path)
    assert new_cfg == old_cfg and new_cfg.rope_scaling.rope_type == "llama3"
