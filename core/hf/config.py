"""Hugging Face `config.json` <-> Temper model section, both ways.

Reads both the older `rope_theta` + `rope_scaling` form and the transformers-5
`rope_parameters` form; writes the older form (`rope_theta`, `rope_scaling`),
which transformers 4.x and 5.x and vLLM all read.
"""

from __future__ import annotations

from typing import Any

from core.config import ModelConfig, MoeConfig
from core.errors import UserError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# The dense family whose attention and config keys a mixture-of-experts family shares.
ATTENTION_OF = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "mistral"}


class UnsupportedHFConfig(UserError, ValueError):
    pass


def model_section_from_hf(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The `model:` config section (a plain dict) described by a Hugging Face config."""
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise UnsupportedHFConfig(
            f"{source}: model_type {family!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )

    def unsupported(flag: str, why: str) -> None:
        raise UnsupportedHFConfig(f"{source}: {flag} is not supported ({why})")

    base = ATTENTION_OF.get(family, family)
    if hf.get("mlp_bias"):
        unsupported("mlp_bias=true", "SwiGLU MLPs here have no biases")
    if base in ("llama", "qwen3", "mistral") and hf.get("attention_bias"):
        unsupported("attention_bias=true", "only Qwen2-style q/k/v biases are implemented")
    if base in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        unsupported("use_sliding_window=true", "per-layer sliding windows are not implemented")

    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "linear", "default"):
            unsupported(f"rope_type={kind!r}", "llama3 and linear scaling are implemented")
        if kind != "default":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            rope_scaling = {"rope_type": kind, **{k: scaling[k] for k in keys if k in scaling}}

    heads = hf["num_attention_heads"]
    section = {
        "family": family,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        "qk_norm": base == "qwen3",
        "sliding_window": hf.get("sliding_window") if base == "mistral" else None,
    }
    if family in ATTENTION_OF:
        section["moe"] = _moe_section(family, hf, source)
        moe = MoeConfig(**section["moe"])
        sparse = {moe.is_sparse(i) for i in range(section["num_layers"])}
        section["scan_layers"] = len(sparse) == 1  # scanned layers must be alike
    return section


def _moe_section(family: str, hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `model.moe` section of a Qwen2-MoE, Qwen3-MoE or Mixtral config; what Temper cannot compute is
    refused."""
    if family == "mixtral":
        if hf.get("router_jitter_noise"):
            raise UnsupportedHFConfig(f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not supported")
        experts, width, normalize, step, dense = hf["num_local_experts"], hf["intermediate_size"], True, 1, []
    else:
        # Hub checkpoints write num_experts, transformers 5's save_pretrained num_local_experts (its attribute map)
        experts, width = hf.get("num_experts", hf.get("num_local_experts")), hf["moe_intermediate_size"]
        normalize, step = bool(hf.get("norm_topk_prob", False)), hf.get("decoder_sparse_step", 1)
        dense = list(hf.get("mlp_only_layers") or [])
    k = hf["num_experts_per_tok"]
    if not isinstance(experts, int) or experts < 2 or not 0 < k <= experts:
        raise UnsupportedHFConfig(
            f"{source}: {'num_local_experts' if family == 'mixtral' else 'num_experts'}={experts} with "
            f"num_experts_per_tok={k}: Temper serves 2 or more experts and 1 <= k <= experts"
        )
    shared = hf.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    if family == "qwen2_moe" and not (isinstance(shared, int) and shared > 0):
        raise UnsupportedHFConfig(f"{source}: shared_expert_intermediate_size={shared}: Temper serves a width > 0")
    return {
        "num_experts": experts,
        "experts_per_token": k,
        "intermediate_size": width,
        "normalize_topk": normalize,
        "sparse_step": step,
        "dense_layers": dense,
        "load_balance_weight": float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
        "shared_intermediate_size": shared,
    }


def hf_config_from_model(cfg: ModelConfig, torch_dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    """A `config.json` dict that transformers and vLLM load for this model."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.model_dump() if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": torch_dtype,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    base = ATTENTION_OF.get(cfg.family, cfg.family)
    if base in ("llama", "qwen3"):
        out["attention_bias"] = False
    if base == "llama":
        out["mlp_bias"] = False
    if base in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    if base == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if cfg.moe is not None:
        out.update(_hf_moe(cfg))
    out.update(extra)
    return out


def _hf_moe(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    assert moe is not None
    common = {
        "num_experts_per_tok": moe.experts_per_token,
        "router_aux_loss_coef": moe.load_balance_weight,
        "output_router_logits": False,
    }
    if cfg.family == "mixtral":  # intermediate_size is the experts' width; every layer sparse, always renormalised
        return {
            **common,
            "num_local_experts": moe.num_experts,
            "intermediate_size": moe.intermediate_size,
            "router_jitter_noise": 0.0,
        }
    return {
        **common,
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "norm_topk_prob": moe.normalize_topk,
        "decoder_sparse_step": moe.sparse_step,
        "mlp_only_layers": list(moe.dense_layers),
        **(
            {"shared_expert_intermediate_size": moe.shared_intermediate_size, "qkv_bias": cfg.attention_bias}
            if cfg.family == "qwen2_moe"
            else {}
        ),
    }
