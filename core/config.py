"""Typed, closed configuration for every Temper job.

One pydantic model per concern, nested under `Config`. Every model forbids
unknown keys. Loading (`core.config_loader.load_config`) reads a YAML file,
follows `base_config:` inheritance, resolves model presets, applies dotted
`key=value` overrides and validates; cross-field checks live here, next to
the fields they constrain, and quote the offending values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.errors import MissingPath


class Section(BaseModel):
    """Base of every config section: closed (unknown keys fail) and immutable once parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- run


class RunConfig(Section):
    name: str = "temper"
    # Everything a run writes (resolved config, checkpoints, metrics, exports) goes here.
    run_dir: str = "runs/temper"
    seed: int = 0


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
    # The grouped matmul (core.models.moe): `ragged_dot` (jax.lax.ragged_dot: a grouped GEMM on GPU and TPU),
    # `tiled` (blocks of rows, each of one expert: on CPU, where ragged_dot lowers to masked work on every
    # expert), or `auto`: tiled on CPU, ragged_dot elsewhere. `capacity` (with capacity_factor > 0): a fixed
    # buffer of capacity rows an expert, as GShard and MaxText's dense path compute it.
    kernel: Literal["auto", "ragged_dot", "tiled", "capacity"] = "auto"

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


# -------------------------------------------------------------------------- mesh


class MeshConfig(Section):
    """Device mesh axis sizes; exactly one may be -1 (fill with the remaining devices)."""

    data: int = 1
    fsdp: int = -1
    # Expert parallelism: a mixture-of-experts model's experts are split over this axis (it must divide
    # model.moe.num_experts), and the batch too (to every other layer it is one more data axis).
    expert: int = 1
    tensor: int = 1
    sequence: int = 1
    # RL device split: fractions of all devices given to the trainer and to the samplers.
    trainer_devices_fraction: float = Field(1.0, ge=0.0, le=1.0)
    sampler_devices_fraction: float = Field(0.0, ge=0.0, le=1.0)
    # Print every parameter's path, shape, dtype, logical axes and physical sharding at start-up.
    debug_sharding: bool = False

    @model_validator(mode="after")
    def _check_axes(self) -> MeshConfig:
        sizes = self.axis_sizes()
        fills = [k for k, v in sizes.items() if v == -1]
        if len(fills) > 1:
            raise ValueError(f"at most one mesh axis may be -1 (fill); got {fills} in {sizes}")
        bad = {k: v for k, v in sizes.items() if v == 0 or v < -1}
        if bad:
            raise ValueError(f"mesh axis sizes must be positive or -1; got {bad}")
        total = self.trainer_devices_fraction + self.sampler_devices_fraction
        if total > 1.0 + 1e-9:
            raise ValueError(
                f"mesh.trainer_devices_fraction ({self.trainer_devices_fraction}) + "
                f"mesh.sampler_devices_fraction ({self.sampler_devices_fraction}) = {total} > 1"
            )
        return self

    def axis_sizes(self) -> dict[str, int]:
        return {
            "data": self.data,
            "fsdp": self.fsdp,
            "expert": self.expert,
            "tensor": self.tensor,
            "sequence": self.sequence,
        }


# -------------------------------------------------------------------------- data


class DataConfig(Section):
    """Where training examples come from and how they become token batches (see core/sources.py, core/data.py)."""

    # A local file or directory (jsonl / parquet / arrow / `save_to_disk` / a dataset repository's files), a Hugging
    # Face Hub dataset id (`trl-lib/ultrafeedback_binarized`: through the hub cache, honouring HF_HUB_OFFLINE; a
    # local path of that name wins), or `reasoning_gym:TASK`.
    source: str | None = None
    subset: str | None = None  # the dataset's configuration (`datasets.load_dataset(source, subset)`)
    split: str = "train"  # the dataset split the rows come from (the held-out rows are data.eval_fraction of it)
    # Temper's field name -> the dataset's column, e.g. {text: content} or {messages: conversations}.
    columns: dict[str, str] = Field(default_factory=dict)
    format: Literal["text", "chat", "prompt_completion"] = "text"
    # Rows generated for a `reasoning_gym:` source.
    num_examples: int = Field(10_000, gt=0)
    # The last fraction of rows is held out as the eval split.
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # A Hugging Face tokenizer directory or Hub model id; unset, recipes build one (core/tokenizer.py) or use the
    # checkpoint's.
    tokenizer_dir: str | None = None
    seq_len: int = Field(256, gt=0)  # the row length, and the most tokens an example keeps
    truncation_side: Literal["right", "left"] = "right"  # which end of a longer example is cut
    packing: bool = True
    # Without packing: a step's `train.batch_size` examples laid out in the fewest rows, not one padded row each.
    padding_free: bool = False
    shuffle: bool = True
    seed: int = 0
    # Skip (and count) malformed rows instead of failing on the first one.
    skip_malformed: bool = False

    @model_validator(mode="after")
    def _check_padding_free(self) -> DataConfig:
        if self.padding_free and self.packing:
            raise ValueError(
                "data.padding_free lays out a padded batch without padding; packing already has none: "
                "set data.packing=false with it"
            )
        return self


# ------------------------------------------------------------------------- optim


class OptimConfig(Section):
    name: Literal["adamw", "sgd", "muon"] = "adamw"
    learning_rate: float = Field(3e-4, ge=0.0)
    schedule: Literal["constant", "cosine", "wsd"] = "cosine"
    warmup_steps_fraction: float = Field(0.0, ge=0.0, le=1.0)
    learning_rate_final_fraction: float = Field(0.1, ge=0.0, le=1.0)
    wsd_decay_steps_fraction: float = Field(0.1, ge=0.0, le=1.0)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = 1.0
    # Regex over the trainable parameters' dotted paths (re.search); only matching ones get updates (None: all).
    # The paths are those of the method's trainable state: `layers.mlp.up_proj.kernel` for a model, and under the
    # tree's attributes where a method trains a module tree (`model.layers...`, `projections.kernels.0`).
    trainable_regex: str | None = None

    @model_validator(mode="after")
    def _check_fractions(self) -> OptimConfig:
        if self.schedule == "wsd":
            total = self.warmup_steps_fraction + self.wsd_decay_steps_fraction
            if total > 1.0 + 1e-9:
                raise ValueError(
                    f"optim.warmup_steps_fraction ({self.warmup_steps_fraction}) + "
                    f"optim.wsd_decay_steps_fraction ({self.wsd_decay_steps_fraction}) = {total} > 1"
                )
        return self


# ------------------------------------------------------------------------- train


class TrainConfig(Section):
    steps: int = Field(100, gt=0)
    batch_size: int = Field(8, gt=0)  # global, in sequences
    micro_batches: int = Field(1, gt=0)  # gradient accumulation inside one step
    nan_policy: Literal["abort", "skip"] = "abort"
    log_every: int = Field(10, gt=0)
    eval_every: int = Field(0, ge=0)  # 0: never
    compile_only: bool = False

    @model_validator(mode="after")
    def _check_micro(self) -> TrainConfig:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.micro_batches ({self.micro_batches})"
            )
        return self


# -------------------------------------------------------------------- checkpoint


class CheckpointConfig(Section):
    # Start from these weights (an HF directory, a Hub model id such as Qwen/Qwen2.5-0.5B-Instruct, or a Temper run /
    # checkpoint; parameters only), e.g. SFT after pretraining. The model shape comes from the checkpoint. Resuming a
    # run takes precedence.
    init_from: str | None = None
    enabled: bool = True
    every_steps: int = Field(100, gt=0)
    keep: int = Field(2, gt=0)
    async_save: bool = True
    # Write a Hugging Face directory (run_dir/hf) at the end of training.
    export_hf: bool = True


# ----------------------------------------------------------------------- logging


class LoggingConfig(Section):
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "temper"
    # Peak FLOP/s per device for MFU; None: datasheet value for known accelerators, else a measured matmul.
    peak_tflops: float | None = Field(None, gt=0.0)


class ProfilerConfig(Section):
    """Write a JAX profiler trace (TensorBoard / Perfetto) for steps [start_step, start_step + num_steps)."""

    enabled: bool = False
    start_step: int = Field(3, ge=1)
    num_steps: int = Field(2, gt=0)
    # Default: <run_dir>/profile
    dir: str | None = None


Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class PlacementConfig(Section):
    """Where a run's Ray actors go: the trainer, as one JAX process or a group of them joined by `jax.distributed`
    (`core.distributed`; on Ray `posttrain.process_group`), and an on-policy run's vLLM samplers, each kind in a
    placement group of its own with a Ray strategy."""

    trainer_processes: int = Field(1, gt=0)  # JAX processes of the trainer, one Ray actor each
    # CPU trainers only: XLA host devices in each trainer process (None: what XLA_FLAGS says, else 1).
    cpu_devices_per_process: int | None = Field(None, gt=0)
    trainer_strategy: Strategy = "PACK"  # its processes talk by collectives: on as few nodes as fit
    sampler_strategy: Strategy = "PACK"
    # How long a trainer process may wait at a barrier for the others (after each compilation: gloo's own reads
    # time out after 30 s, and processes compile at different speeds), and for the group to form.
    barrier_timeout_s: int = Field(600, gt=0)
    # How long the driver waits for one call to the trainer's processes (an on-policy step, sync or checkpoint)
    # and, for an offline group, for process 0's output to grow, before it stops the group as hung.
    call_timeout_s: int = Field(3600, gt=0)


# ------------------------------------------------------------------------- root


class Config(Section):
    """The whole job of the core engine (pretraining). Sections are nested, never merged; post-training methods
    add theirs in `posttrain.config.PostTrainConfig`. Each method checks what it needs of several sections at
    once itself, before anything starts (`check` functions next to the method), so a job never fails on the
    checks of a method it does not run."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    def check_at_load(self, source: str) -> None:
        """What loading a user's config checks beyond its schema (`core.config_loader.load_config`; never when a
        config is read back from a run directory): every local path it names exists (a Hub id is resolved when the
        run starts)."""
        from core.hub import looks_like_hub_id

        paths = {"checkpoint.init_from": self.checkpoint.init_from, "data.tokenizer_dir": self.data.tokenizer_dir}
        if self.data.source is not None and not self.data.source.startswith("reasoning_gym:"):
            paths["data.source"] = self.data.source
        for key, value in paths.items():
            if value is not None and not Path(value).exists() and not looks_like_hub_id(value):
                raise MissingPath(f"{source}: {key}: {value} does not exist (and is not a Hugging Face Hub id)")


def resolve_mesh_shape(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with the -1 axis filled in; raises when they cannot cover `num_devices` exactly."""
    sizes = mesh.axis_sizes()
    fixed = 1
    for v in sizes.values():
        if v != -1:
            fixed *= v
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"mesh axes {sizes}: the fixed axes multiply to {fixed}, which does not divide "
                f"the {num_devices} available devices, so mesh.{fill[0]}=-1 cannot be filled"
            )
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh axes {sizes} multiply to {fixed} but {num_devices} devices are available; "
            f"make the product equal {num_devices} or set one axis to -1"
        )
    return sizes
