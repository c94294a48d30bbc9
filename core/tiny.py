"""Tiny random Hugging Face models, built locally with `transformers` (no hub access needed).

Used by the tests, the benchmarks and the demo as independent references: the
weights are randomised (norm scales and biases too) so a wrong mapping of any
tensor shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")  # 4 experts of width 32, top-2


def tiny_hf_config(family: str, tied: bool = False, **overrides: Any):
    """A transformers config: 2 layers, hidden 64, GQA 4/2 heads, vocab 512, float32."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    cls: type[tf.PretrainedConfig]
    extra: dict[str, Any]
    if family == "llama":
        scaling = dict(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
            rope_theta=10000.0,
        )
        cls, extra = tf.LlamaConfig, dict(rope_parameters=scaling)
    elif family == "qwen2":
        cls, extra = tf.Qwen2Config, dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))
    elif family == "qwen3":
        # head_dim independent of hidden_size / num_heads, as in real Qwen3 models.
        cls, extra = tf.Qwen3Config, dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    elif family == "mistral":
        cls, extra = tf.MistralConfig, dict(sliding_window=None)
    elif family == "qwen2_moe":  # q/k/v biases (qkv_bias), a shared expert of width 48 beside the routed ones
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        cls, extra = tf.Qwen2MoeConfig, dict(rope_parameters=dict(rope_type="default", rope_theta=1e6), **moe)
    elif family == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        cls, extra = (
            tf.Qwen3MoeConfig,
            dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e6), **moe),
        )
    elif family == "mixtral":
        cls, extra = (
            tf.MixtralConfig,
            dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        )
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + MOE_FAMILIES}")
    return cls(**{**common, **extra, **overrides})


def save_tiny_hf_model(path: str | Path, family: str, tied: bool = False, seed: int = 0, **overrides: Any) -> Path:
    """Build a randomly initialised tiny model for `family` and `save_pretrained` it to `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, tied, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    path = Path(path)
    model.save_pretrained(path)
    return path
