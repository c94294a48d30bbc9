"""Typed, closed configuration for every Temper job.

One pydantic model per concern, nested under `Config`. Every model forbids
unknown keys. Loading (`core.config_loader.load_config`) reads a YAML file,
follows `base_config:` inheritance, resolves model presets, applies dotted
`key=value` overrides and validates; cross-field checks live here, next to
the fields they constrain, and quote the offending values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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


class ModelConfig(Section):
    """Shape and numerics of a decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral)."""

    # Name of the preset this config started from (informational once resolved).
    preset: str | None = None
    family: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
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
    attention_impl: Literal["xla", "dot_product", "cudnn"] = "xla"
    # The log-prob head (core/kernels/logprobs.py) keeps a micro-batch's [targets, vocab] float32 logits for the
    # backward pass when they fit in logits_budget_mb (three matmuls); above it, it walks the vocabulary in
    # vocab_chunk_size tiles and recomputes them in the backward (a fourth matmul, O(targets x tile) memory).
    # 512 MB holds a DPO batch of 8 pairs x 2 completions of up to 168 targets at a 32k vocabulary (~0.9 s a
    # step saved at 100M, bench/dpo_step.py); peers keep every position's logits.
    logits_budget_mb: float = Field(512, ge=0)
    vocab_chunk_size: int = Field(8192, gt=0)

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
        return self


# -------------------------------------------------------------------------- mesh


class MeshConfig(Section):
    """Device mesh axis sizes; exactly one may be -1 (fill with the remaining devices)."""

    data: int = 1
    fsdp: int = -1
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
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "sequence": self.sequence}


# -------------------------------------------------------------------------- data


class DataConfig(Section):
    """Where training examples come from and how they become token batches (see core/data.py)."""

    # A local file or directory (jsonl / parquet / arrow / `save_to_disk`) or `reasoning_gym:TASK`.
    source: str | None = None
    format: Literal["text", "chat", "prompt_completion"] = "text"
    text_field: str = "text"
    # Rows generated for a `reasoning_gym:` source.
    num_examples: int = Field(10_000, gt=0)
    # The last fraction of rows is held out as the eval split.
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # A local Hugging Face tokenizer directory; recipes may build one (core/tokenizer.py) when unset.
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
    # Regex over parameter paths; only matching parameters train (None: all).
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
    # Start from these weights (an HF directory or a Temper run / checkpoint; parameters only), e.g. SFT
    # after pretraining. The model shape comes from the checkpoint. Resuming a run takes precedence.
    init_from: str | None = None
    enabled: bool = True
    every_steps: int = Field(100, gt=0)
    keep: int = Field(2, gt=0)
    async_save: bool = True
    # Write a Hugging Face directory (run_dir/hf) at the end of training.
    export_hf: bool = True


# ----------------------------------------------------------------------- rollout


class RolloutConfig(Section):
    sampler: Literal["vllm", "jax"] = "vllm"
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1  # -1: off
    max_tokens: int = Field(128, gt=0)
    max_model_len: int = Field(1024, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    kv_cache_gib: float = Field(1.0, gt=0.0)
    dtype: DType = "float32"
    enforce_eager: bool = True
    # Cores for vLLM's OpenMP threads per sampler, e.g. "0" or "0-1"; None lets vLLM choose.
    omp_threads_bind: str | None = None
    reshard_chunk_bytes: int = Field(256 * 1024 * 1024, gt=0)
    rollout_data_parallelism: int = Field(1, gt=0)  # vLLM sampler actors, each with the whole model
    sampler_timeout_s: float = Field(600.0, gt=0.0)  # a sampler call slower than this counts as dead

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


# ---------------------------------------------------------------------------- rl


# The GSPO paper's clip range (Zheng et al., 2025, section 5.1): sequence ratios stay within ~1e-3 of 1.
GSPO_EPSILON, GSPO_EPSILON_HIGH = 3e-4, 4e-4


class RLBatchConfig(Section):
    """`rl.batch`: what one RL step samples and how it is cut into updates and packed rows."""

    prompts_per_step: int = Field(4, gt=0)
    num_generations: int = Field(4, gt=1)  # completions per prompt (the group)
    num_iterations: int = Field(1, gt=0)  # mu: passes over each rollout batch
    mini_batches: int = Field(1, gt=0)  # optimizer updates per pass
    pack_sequences: bool = True  # several prompt + completion sequences per trainer row (less padding)
    share_prompts: bool = True  # packed: a prompt's completions share one copy of it (each prompt token trained once)
    pack_length: int = Field(0, ge=0)  # packed row length in tokens; 0 = rollout.max_model_len
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill the batch
    max_sampling_rounds: int = Field(4, gt=0)


class RLLossConfig(Section):
    """`rl.loss`: the clipped policy objective, its aggregation and the KL term (posttrain/losses)."""

    epsilon: float = Field(0.2, ge=0.0)
    epsilon_high: float = Field(0.2, ge=0.0)  # DAPO clip-higher: > epsilon
    dual_clip: float | None = Field(None, gt=1.0)
    tis_cap: float | None = Field(2.0, gt=0.0)  # truncated importance sampling vs the sampler; None = off
    loss_agg: Literal["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"] = "token-mean"
    mask_truncated: bool = False  # DAPO: completions cut at max_tokens add no policy-loss tokens
    beta: float = Field(0.0, ge=0.0)  # KL coefficient; 0 loads no reference model
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    # The KL term on every completion token (zero-variance groups and truncated completions too, as TRL
    # and verl); false: only where the policy term applies (Temper before 2026-11).
    kl_every_token: bool = True

    @model_validator(mode="after")
    def _check(self) -> RLLossConfig:
        if self.epsilon_high < self.epsilon:
            raise ValueError(f"rl.loss.epsilon_high ({self.epsilon_high}) must be >= rl.loss.epsilon ({self.epsilon})")
        return self


class AdvantageConfig(Section):
    """`rl.advantage`: how a group's rewards become advantages (posttrain/advantages.py)."""

    estimator: Literal["group_norm", "drgrpo", "rloo"] = "group_norm"
    std_eps: float = Field(1e-4, gt=0.0)  # group_norm: (r - mean) / (std + std_eps), as TRL


class RLConfig(Section):
    """GRPO / GSPO and their variants (posttrain/grpo.py; docs/grpo.md), by concern: `rl.batch`, `rl.loss`,
    `rl.advantage`, and the prompts, async bound and evaluation here.

    `rl.loss.epsilon`, `epsilon_high` and `loss_agg` default by algorithm: GRPO 0.2 / 0.2 / token-mean, GSPO
    3e-4 / 4e-4 / sequence-mean-token-mean (the GSPO paper's); a value given explicitly always wins.
    The policy starts from `checkpoint.init_from` (None: a random init, for tests).
    """

    algorithm: Literal["grpo", "gspo"] = "grpo"
    prompt_template: str = "{question}"  # formatted with each dataset row
    use_chat_template: bool = False
    batch: RLBatchConfig = Field(default_factory=RLBatchConfig)
    loss: RLLossConfig = Field(default_factory=RLLossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    off_policy_steps: int = Field(0, ge=0)  # async: completions at most this many versions old
    accuracy_fn: str = "math_verify"  # reward function that defines "correct" (value > 0) for metrics / eval
    eval_prompts: int = Field(64, gt=0)  # held-out prompts per evaluation (train.eval_every)
    eval_samples: int = Field(4, gt=0)  # sampled completions per prompt for pass@k / maj@k

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data):
        """Fill the clip range and aggregation the algorithm's paper uses where the user named none."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        loss = data.get("loss")
        if isinstance(loss, BaseModel):
            return data  # already built (a model_copy): its defaults were filled then
        loss = dict(loss or {})
        gspo = data.get("algorithm") == "gspo"
        if loss.get("epsilon") is None:
            loss["epsilon"] = GSPO_EPSILON if gspo else 0.2
            if loss.get("epsilon_high") is None and gspo:
                loss["epsilon_high"] = GSPO_EPSILON_HIGH
        if loss.get("epsilon_high") is None:
            loss["epsilon_high"] = loss["epsilon"]
        if loss.get("loss_agg") is None:
            loss["loss_agg"] = "sequence-mean-token-mean" if gspo else "token-mean"
        data["loss"] = loss
        return data


# ---------------------------------------------------------------------------- sft


class SFTConfig(Section):
    """Supervised fine-tuning (posttrain/sft.py; docs/sft.md)."""

    # Train only on assistant / completion tokens (prompt, system and user tokens masked out).
    completion_only_loss: bool = True
    # At each evaluation (train.eval_every): greedy completions of this many held-out prompts, logged to
    # run_dir/generations.jsonl (0: none).
    eval_generations: int = Field(4, ge=0)
    eval_max_new_tokens: int = Field(64, gt=0)


# ---------------------------------------------------------------------------- dpo


class DPOConfig(Section):
    """Preference optimisation (posttrain/dpo.py, posttrain/losses/preference.py; docs/dpo.md)."""

    loss_type: Literal["sigmoid", "robust", "ipo", "hinge", "exo_pair", "simpo", "orpo"] = "sigmoid"
    beta: float = Field(0.1, gt=0.0)  # ORPO: the odds-ratio term's weight (lambda)
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)  # sigmoid (cDPO), robust, exo_pair, simpo
    simpo_gamma: float = 0.5  # SimPO's target margin
    rpo_alpha: float = Field(0.0, ge=0.0)  # weight of the chosen completion's mean NLL, any loss type
    # Prompts keep their last tokens, completions their first (None: only data.seq_len bounds a pair).
    max_prompt_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    # Score every pair with the reference once, before training, into run_dir/reference_logps.npz (reused on
    # resume) and release the reference; False: score each batch live, the reference held in memory.
    precompute_ref_logps: bool = False
    # Online DPO (posttrain/online_dpo.py): pairs from the policy's own samples, the best and worst of
    # rl.batch.num_generations per prompt by the reward functions, with the sampler, reward and rl.* settings GRPO
    # reads; False: offline, pairs from data.source.
    online: bool = False

    @model_validator(mode="after")
    def _check_smoothing(self) -> DPOConfig:
        smoothed = ("sigmoid", "robust", "exo_pair", "simpo")  # posttrain.losses.preference.SMOOTHED
        if self.label_smoothing > 0 and self.loss_type not in smoothed:
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing}: loss_type {self.loss_type!r} has no label smoothing "
                f"(only {', '.join(smoothed)} do)"
            )
        return self


# ------------------------------------------------------------------------ reward


class RewardFn(Section):
    """One reward function: a built-in name, `package.module:function`, `path/file.py:function` or an entry point.

    Validation never imports it: a config read back from a run directory (a checkpoint) must not run
    code. `core.config_loader.load_config` resolves every function once, so a typo fails at load.
    """

    fn: str
    weight: float = 1.0
    kwargs: dict = Field(default_factory=dict)


class RewardConfig(Section):
    functions: list[RewardFn] = Field(default_factory=list)
    math_verify_timeout: float = Field(10.0, gt=0.0)
    math_verify_num_procs: int = Field(2, gt=0)
    # None: a completion a reward function failed on (raised, hung, NaN) drops its whole group from the loss.
    # A number: score such failures as that value instead (an explicit opt-in).
    failure_reward: float | None = None


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


# ------------------------------------------------------------------------- root


class Config(Section):
    """The whole job. Sections are nested, never merged."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)

    @model_validator(mode="after")
    def _check_rl(self) -> Config:
        """What an RL run needs of several sections at once, checked before anything starts."""
        rl, rollout, batch = self.rl, self.rollout, self.rl.batch
        updates = batch.mini_batches * self.train.micro_batches
        completions = batch.prompts_per_step * batch.num_generations
        if completions % updates:
            raise ValueError(
                f"rl.batch.prompts_per_step * rl.batch.num_generations ({batch.prompts_per_step} * "
                f"{batch.num_generations} = {completions}) must be divisible by rl.batch.mini_batches * "
                f"train.micro_batches ({batch.mini_batches} * {self.train.micro_batches} = {updates})"
            )
        if rollout.max_tokens >= rollout.max_model_len:
            raise ValueError(
                f"rollout.max_tokens ({rollout.max_tokens}) must be < rollout.max_model_len "
                f"({rollout.max_model_len}): a prompt needs at least one token of the model length"
            )
        if rl.off_policy_steps and rollout.sampler != "vllm":
            raise ValueError(
                f"rl.off_policy_steps={rl.off_policy_steps} (async) needs rollout.sampler=vllm: "
                f"the JAX sampler shares the trainer's process"
            )
        if batch.pack_length and batch.pack_length < rollout.max_model_len:
            raise ValueError(
                f"rl.batch.pack_length ({batch.pack_length}) < rollout.max_model_len "
                f"({rollout.max_model_len}): a full-length sequence would not fit in a row"
            )
        return self


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
