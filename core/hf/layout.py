"""Names and layouts of every parameter in Hugging Face form: the one table both directions use.

Temper keeps projections as `[in, ..., out]` einsum kernels with heads split
out (`q_proj.kernel` is [D, N, H]); Hugging Face / vLLM keep `nn.Linear`
weights `[out, in]` with heads flattened. `param_map(cfg)` lists, for every
tensor Hugging Face names, the core parameter path, the layer index inside a
stacked (scanned) parameter and the expert index inside a mixture-of-experts
layer's stacked experts (Hugging Face checkpoints hold experts one by one),
and the layout conversion. Export (`save_hf`), import (`load_hf`) and weight
sync to vLLM all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.config import ModelConfig


def _flat_out_in(x):  # [D, N, H] -> [N*H, D]
    return x.reshape(x.shape[0], -1).T


def _o_flat(x):  # [N, H, D] -> [D, N*H]
    return x.reshape(-1, x.shape[-1]).T


# kind -> (core -> HF, HF -> core given the core shape)
LAYOUTS: dict[str, tuple[Callable, Callable]] = {
    "identity": (lambda x: x, lambda x, shape: x.reshape(shape)),
    "linear": (lambda x: x.T, lambda x, shape: x.T.reshape(shape)),
    "heads_in": (_flat_out_in, lambda x, shape: x.T.reshape(shape)),  # q/k/v kernels
    "heads_bias": (lambda x: x.reshape(-1), lambda x, shape: x.reshape(shape)),
    "heads_out": (_o_flat, lambda x, shape: x.T.reshape(shape)),  # o_proj kernel
}

# (core path inside a layer, HF name inside `model.layers.{i}.`, layout kind, needed when)
LAYER_TABLE: list[tuple[tuple[str, ...], str, str, Callable[[ModelConfig], bool]]] = [
    (("input_norm", "scale"), "input_layernorm.weight", "identity", lambda c: True),
    (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", "heads_in", lambda c: True),
    (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", "heads_in", lambda c: True),
    (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", "heads_in", lambda c: True),
    (("attn", "q_proj", "bias"), "self_attn.q_proj.bias", "heads_bias", lambda c: c.attention_bias),
    (("attn", "k_proj", "bias"), "self_attn.k_proj.bias", "heads_bias", lambda c: c.attention_bias),
    (("attn", "v_proj", "bias"), "self_attn.v_proj.bias", "heads_bias", lambda c: c.attention_bias),
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "identity", lambda c: c.qk_norm),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "identity", lambda c: c.qk_norm),
    (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", "heads_out", lambda c: True),
    (("post_attn_norm", "scale"), "post_attention_layernorm.weight", "identity", lambda c: True),
    (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", "linear", lambda c: True),
    (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", "linear", lambda c: True),
    (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", "linear", lambda c: True),
]
_DENSE_MLP = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}

# A sparse layer's router and experts (`core.models.moe.MoeBlock`): core parameter, HF name per family ({e}: the
# expert), whether one tensor per expert. The three families store `nn.Linear` weights [out, in].
_QWEN_MOE = {
    "router": "mlp.gate.weight",
    "w_gate": "mlp.experts.{e}.gate_proj.weight",
    "w_up": "mlp.experts.{e}.up_proj.weight",
    "w_down": "mlp.experts.{e}.down_proj.weight",
}
_MIXTRAL = {
    "router": "block_sparse_moe.gate.weight",
    "w_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "w_up": "block_sparse_moe.experts.{e}.w3.weight",
    "w_down": "block_sparse_moe.experts.{e}.w2.weight",
}
# (a family missing from a row has no such tensor: only Qwen2-MoE has the shared expert and its gate)
MOE_TABLE: list[tuple[str, dict[str, str], bool]] = [
    *[
        (p, {"qwen2_moe": _QWEN_MOE[p], "qwen3_moe": _QWEN_MOE[p], "mixtral": _MIXTRAL[p]}, p != "router")
        for p in _MIXTRAL
    ],
    ("shared_gate", {"qwen2_moe": "mlp.shared_expert.gate_proj.weight"}, False),
    ("shared_up", {"qwen2_moe": "mlp.shared_expert.up_proj.weight"}, False),
    ("shared_down", {"qwen2_moe": "mlp.shared_expert.down_proj.weight"}, False),
    ("shared_router", {"qwen2_moe": "mlp.shared_expert_gate.weight"}, False),
]

_TOP_TABLE: list[tuple[tuple[str, ...], str, str, Callable[[ModelConfig], bool]]] = [
    (("embed", "embedding"), "model.embed_tokens.weight", "identity", lambda c: True),
    (("final_norm", "scale"), "model.norm.weight", "identity", lambda c: True),
    (("lm_head", "kernel"), "lm_head.weight", "linear", lambda c: not c.tie_word_embeddings),
]


@dataclass(frozen=True)
class ParamMapping:
    hf_name: str
    core_path: tuple  # path in the core model's flat state
    # The tensor's place along the core parameter's leading stacked axes: (layer,) in a scanned parameter,
    # (expert,) or (layer, expert) for one expert of a layer's stacked experts; () for a whole parameter.
    index: tuple[int, ...]
    kind: str

    def to_hf(self, core_value: np.ndarray) -> np.ndarray:
        """This tensor in HF layout, from the (possibly stacked) core parameter value."""
        return self.layer_to_hf(core_value[self.index] if self.index else core_value)

    def layer_to_hf(self, value: np.ndarray) -> np.ndarray:
        """HF layout of this tensor's own value (its part of a stacked parameter)."""
        return LAYOUTS[self.kind][0](value)

    def hf_shape(self, core_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape, given the (possibly stacked) core parameter's shape."""
        # A zero-stride view has the right shape and costs no memory.
        return tuple(self.to_hf(np.broadcast_to(np.float32(0), core_shape)).shape)

    def from_hf(self, hf_value: np.ndarray, core_shape: tuple[int, ...]) -> np.ndarray:
        """The core-layout value of this tensor's part (`core_shape` without the stacked axes `index` covers)."""
        return LAYOUTS[self.kind][1](hf_value, core_shape)


def param_map(cfg: ModelConfig) -> list[ParamMapping]:
    """Every Hugging Face tensor of this model, in HF order (embeddings, layers, norm, head)."""
    out = [ParamMapping(n, p, (), k) for p, n, k, need in _TOP_TABLE[:1] if need(cfg)]
    for i, sparse in enumerate(cfg.sparse_layers):
        where = ("layers",) if cfg.scan_layers else ("layers", i)
        layer = (i,) if cfg.scan_layers else ()
        prefix = f"model.layers.{i}."
        for sub, name, kind, need in LAYER_TABLE:
            if need(cfg) and not (sparse and name in _DENSE_MLP):
                out.append(ParamMapping(prefix + name, (*where, *sub), layer, kind))
        if sparse:
            assert cfg.moe is not None
            for sub_name, names, per_expert in MOE_TABLE:
                if cfg.family not in names:
                    continue
                path = (*where, "mlp", sub_name)
                if not per_expert:
                    out.append(ParamMapping(prefix + names[cfg.family], path, layer, "linear"))
                    continue
                for e in range(cfg.moe.num_experts):
                    out.append(ParamMapping(prefix + names[cfg.family].format(e=e), path, (*layer, e), "linear"))
    out += [ParamMapping(n, p, (), k) for p, n, k, need in _TOP_TABLE[1:] if need(cfg)]
    return out
