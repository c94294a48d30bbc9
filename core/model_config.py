"""The model's part of the config (`model.*`): shape and numerics of a decoder-only transformer, its LoRA adapters
and its mixture-of-experts layers. `core.config` re-exports every name here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.config_section import Section

# ------------------------------------------------------------------------- model


class RopeScaling(Section):
    """RoPE frequency scaling. `llama3` is Llama 3.1's piecewise rule; `linear` divides positions."""

    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


DType = Literal["float32", "bfloat16"]
AttentionImpl = Literal["xla", "dot_product", "cudnn"]  # core/kernels/attention.py implements each


# The projections LoRA can adapt, by their Hugging Face names (PEFT's `target_modules`).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """`model.lora`: low-rank adapters on the projections named in `target_modules` (Hu et al., 2021; PEFT's
    layout and scaling), the base frozen; with `quantize_base` the frozen base is stored quantized (QLoRA).

    y = x W + (alpha / r) * dropout(x) A B     (alpha / sqrt(r) with use_rslora, Kalajdzievski 2023)
    """

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = LORA_TARGETS  # a tuple: the model's config is hashable (static under jit)
    use_rslora: bool = False
    # A's initialisation (B starts at zero, so the adapted model starts as the base): PEFT's default (Kaiming
    # uniform, bound 1/sqrt(fan_in)) or "gaussian" (normal, std 1/r).
    init: Literal["default", "gaussian"] = "default"
    # QLoRA: the frozen projections of the base stored as int8 (per output channel) or 4-bit NormalFloat (blocks
    # of `quant_block_size` input elements, two codes a byte), dequantized in the forward pass; embeddings,
    # norms and the output head stay as they are.
    quantize_base: Literal["none", "int8", "nf4"] = "none"
    quant_block_size: int = Field(64, gt=0)

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        """Known modules, each once, in the model's order (so two configs naming the same set compare equal)."""
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"model.lora.target_modules {list(targets)}: each must be one of {list(LORA_TARGETS)} "
                f"(and at least one){'; unknown: ' + ', '.join(unknown) if unknown else ''}"
            )
        if len(set(targets)) != len(targets):
            raise ValueError(f"model.lora.target_modules {list(targets)} names a module twice")
        return tuple(t for t in LORA_TARGETS if t in targets)

    @field_validator("quant_block_size")
    @classmethod
    def _check_block(cls, size: int) -> int:
        if size % 2:
            raise ValueError(f"model.lora.quant_block_size={size} must be even (NF4 packs two codes a byte)")
        return size


class MoeConfig(Section):
    """`model.moe`: sparse mixture-of-experts feed-forward layers (Qwen3-MoE, Mixtral; `core.models.moe`).

    Each sparse layer routes every token to `experts_per_token` of `num_experts` SwiGLU experts of width
    `intermediate_size`: a softmax over the router's logits, its k largest kept (renormalised to sum to 1 when
    `normalize_topk`: Qwen3-MoE's `norm_topk_prob`, always on for Mixtral). Dropless: every routed token is
    computed, unless `capacity_factor` > 0: then each expert takes at most ceil(capacity_factor * tokens * k /
    num_experts) of a layer's assignments, in token order over the forward pass's real tokens, and drops the rest
    (they add nothing to the token's output; `moe/dropped` logs their share). Layer i (from 0) is sparse when
    (i + 1) % `sparse_step` == 0 and i is not in `dense_layers` (Qwen3-MoE's
    `decoder_sparse_step`, `mlp_only_layers`); the others keep the dense MLP of `model.intermediate_size`.
    """

    num_experts: int = Field(8, gt=1)
    experts_per_token: int = Field(2, gt=0)
    intermediate_size: int = Field(64, gt=0)
    normalize_topk: bool = True
    sparse_step: int = Field(1, gt=0)
    dense_layers: tuple[int, ...] = ()
    # The load-balancing loss (Switch Transformer's, as transformers computes it for both families: the share of
    # top-k assignments and the mean router probability per expert, pooled over the sparse layers and the real
    # tokens; num_experts * their dot product) and the router z-loss (mean squared logsumexp of the router logits,
    # ST-MoE), each weighted into every method's training loss.
    load_balance_weight: float = Field(0.0, ge=0.0)
    # Qwen2-MoE's shared expert: a SwiGLU MLP of this width that every token goes through beside its routed
    # experts, scaled by sigmoid(its own gate); 0: none (Qwen3-MoE, Mixtral).
    shared_intermediate_size: int = Field(0, ge=0)
    router_z_loss_weight: float = Field(0.0, ge=0.0)
    # <= 0: dropless (MaxText's -1); > 0: GShard's capacity factor (1.0: an even share an expert).
    capacity_factor: float = 0.0
    # The grouped matmul (core.kernels.experts): `ragged_dot` (jax.lax.ragged_dot: a grouped GEMM on GPU and TPU),
    # `tiled` (blocks of rows, each of one expert: on CPU, where ragged_dot lowers to masked work on every
    # expert), `rounds` (dropless capacity rounds, every expert's weights multiplied in place), or `auto`: tiled
    # on CPU, ragged_dot elsewhere. `capacity` (with capacity_factor > 0): a fixed buffer of capacity rows an
    # expert, as GShard and MaxText's dense path compute it.
    kernel: Literal["auto", "ragged_dot", "tiled", "rounds", "capacity"] = "auto"

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has the experts instead of the dense MLP."""
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers

    @model_validator(mode="after")
    def _check_topk(self) -> MoeConfig:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"model.moe.experts_per_token ({self.experts_per_token}) exceeds model.moe.num_experts "
                f"({self.num_experts})"
            )
        if self.kernel == "capacity" and self.capacity_factor <= 0:
            raise ValueError("model.moe.kernel=capacity needs model.moe.capacity_factor > 0 (it is dropless at <= 0)")
        return self


class ModelConfig(Section):
    """Shape and numerics of a decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral)."""

    # Name of the preset this config started from (informational once resolved).
    preset: str | None = None
    family: Literal["llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral"] = "llama"
    vocab_size: int = Field(512, gt=0)
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    # None means hidden_size // num_heads; Qwen3 sets it independently.
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2/2.5: biases on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None  # Mistral v0.1
    # Compute dtype of activations/matmuls; logits are always returned in float32.
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    scan_layers: bool = True
    # lax.scan's `unroll` for the scanned layers of a training / scoring pass: True runs them as straight-line
    # code (the fastest step: a rolled loop zero-fills and copies the stacked activations it saves for the
    # backward pass, ~5% of a 56M SFT step on CPU), k >= 1 unrolls k layers per loop iteration (1 = one layer
    # body, the fastest compile for deep models). Parameters stay stacked either way; decoding is not unrolled.
    scan_unroll: bool | int = True
    remat_policy: Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"] = "none"
    attention_impl: AttentionImpl = "xla"
    # The log-prob head (core/kernels/logprobs.py) keeps a micro-batch's [targets, vocab] float32 logits for the
    # backward pass when they fit in logits_budget_mb (three matmuls); above it, it walks the vocabulary in
    # vocab_chunk_size tiles and recomputes them in the backward (a fourth matmul, O(targets x tile) memory).
    # 512 MB holds a DPO batch of 8 pairs x 2 completions of up to 168 targets at a 32k vocabulary (~0.9 s a
    # step saved at 100M, bench/dpo_step.py); peers keep every position's logits.
    logits_budget_mb: float = Field(512, ge=0)
    vocab_chunk_size: int = Field(8192, gt=0)
    # LoRA adapters (and QLoRA's quantized base): None trains every parameter.
    lora: LoraConfig | None = None
    # Mixture-of-experts feed-forward layers (the `qwen2_moe`, `qwen3_moe` and `mixtral` families); None: every
    # layer dense.
    moe: MoeConfig | None = None

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if not isinstance(self.scan_unroll, bool) and self.scan_unroll < 1:
            raise ValueError(f"model.scan_unroll must be true, false or a layer count >= 1 (got {self.scan_unroll})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_heads "
                f"({self.num_heads}); set model.head_dim explicitly"
            )
        self._check_moe()
        return self

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per decoder layer, whether it holds the experts (`model.moe`) instead of the dense MLP."""
        return tuple(self.moe is not None and self.moe.is_sparse(i) for i in range(self.num_layers))

    def _check_moe(self) -> None:
        moe_family = self.family in ("qwen2_moe", "qwen3_moe", "mixtral")
        if moe_family != (self.moe is not None):
            raise ValueError(
                f"model.moe is {'unset' if self.moe is None else 'set'} but model.family is {self.family!r}: "
                "the qwen2_moe, qwen3_moe and mixtral families, and only they, have experts"
            )
        if self.moe is None:
            return
        if (self.family == "qwen2_moe") != (self.moe.shared_intermediate_size > 0):
            raise ValueError(
                f"model.moe.shared_intermediate_size={self.moe.shared_intermediate_size} with family "
                f"{self.family!r}: Qwen2-MoE layers, and only they, have a shared expert (a width > 0)"
            )
        outside = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(
                f"model.moe.dense_layers {outside} are not layers of this model (0..{self.num_layers - 1})"
            )
        if self.family == "mixtral" and not all(self.sparse_layers):
            raise ValueError("model.moe: every Mixtral layer is sparse (sparse_step 1, no dense_layers)")
        if self.lora is not None:
            raise ValueError("model.lora on a mixture-of-experts model (model.moe) is not implemented")
        if self.scan_layers and len(set(self.sparse_layers)) > 1:
            raise ValueError(
                "model.scan_layers needs every layer alike, and model.moe makes layers "
                f"{[i for i, s in enumerate(self.sparse_layers) if not s]} dense and the others sparse: "
                "set model.scan_layers=false"
            )
