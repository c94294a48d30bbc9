"""Names and layouts of every parameter in Hugging Face form: the one table both directions use.

Temper keeps projections as `[in, ..., out]` einsum kernels with heads split
out (`q_proj.kernel` is [D, N, H]); Hugging Face / vLLM keep `nn.Linear`
weights `[out, in]` with heads flattened. `param_map(cfg)` lists, for every
tensor Hugging Face names, the core parameter path, the layer index inside a
stacked (scanned) parameter, and the layout conversion. Export (`save_hf`),
import (`load_hf`) and weight sync to vLLM all read it.
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

_TOP_TABLE: list[tuple[tuple[str, ...], str, str, Callable[[ModelConfig], bool]]] = [
    (("embed", "embedding"), "model.embed_tokens.weight", "identity", lambda c: True),
    (("final_norm", "scale"), "model.norm.weight", "identity", lambda c: True),
    (("lm_head", "kernel"), "lm_head.weight", "linear", lambda c: not c.tie_word_embeddings),
]


@dataclass(frozen=True)
class ParamMapping:
    hf_name: str
    core_path: tuple  # path in the core model's flat state
    layer: int | None  # index along the leading `layers` axis of a scanned parameter
    kind: str

    def to_hf(self, core_value: np.ndarray) -> np.ndarray:
        """This tensor in HF layout, from the (possibly stacked) core parameter value."""
        return self.layer_to_hf(core_value if self.layer is None else core_value[self.layer])

    def layer_to_hf(self, value: np.ndarray) -> np.ndarray:
        """HF layout of this tensor's own value (one layer of a stacked parameter)."""
        return LAYOUTS[self.kind][0](value)

    def hf_shape(self, core_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape, given the (possibly stacked) core parameter's shape."""
        # A zero-stride view has the right shape and costs no memory.
        return tuple(self.to_hf(np.broadcast_to(np.float32(0), core_shape)).shape)

    def from_hf(self, hf_value: np.ndarray, core_shape: tuple[int, ...]) -> np.ndarray:
        """The core-layout value for one layer (`core_shape` without the `layers` axis)."""
        return LAYOUTS[self.kind][1](hf_value, core_shape)


def param_map(cfg: ModelConfig) -> list[ParamMapping]:
    """Every Hugging Face tensor of this model, in HF order (embeddings, layers, norm, head)."""
    out = [ParamMapping(n, p, None, k) for p, n, k, need in _TOP_TABLE[:1] if need(cfg)]
    for i in range(cfg.num_layers):
        for sub, name, kind, need in LAYER_TABLE:
            if not need(cfg):
                continue
            path = ("layers", *sub) if cfg.scan_layers else ("layers", i, *sub)
            out.append(ParamMapping(f"model.layers.{i}.{name}", path, i if cfg.scan_layers else None, kind))
    out += [ParamMapping(n, p, None, k) for p, n, k, need in _TOP_TABLE[1:] if need(cfg)]
    return out
