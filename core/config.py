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

from pydantic import Field, model_validator

from core.compile_cache import default_cache_dir
from core.config_section import Section
from core.errors import MissingPath
from core.model_config import (  # noqa: F401  (re-exported: the model section lives there)
    LORA_TARGETS,
    AttentionImpl,
    DType,
    LoraConfig,
    ModelConfig,
    MoeConfig,
    RopeScaling,
)

# --------------------------------------------------------------------------- run


class RunConfig(Section):
    name: str = "temper"
    # Everything a run writes (resolved config, checkpoints, metrics, exports) goes here.
    run_dir: str = "runs/temper"
    seed: int = 0


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
    eval_on_start: bool = False  # evaluate before the first step too (step 0; HF Trainer's eval_on_start)
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


class CompileConfig(Section):
    """How a run compiles its steps (`core.compile_cache`, `core.shape_plan`)."""

    # JAX's persistent compilation cache: every executable a run compiles is written here, and any later process on
    # this machine loads it instead of compiling it again (a resumed run, a second run of a recipe, a Ray job's
    # trainer). Default: $JAX_COMPILATION_CACHE_DIR when set, else $XDG_CACHE_HOME/temper/jax (~/.cache/temper/jax).
    # null: off. Whoever can write to it can run code in the runs that read it: keep it private.
    cache_dir: str | None = Field(default_factory=default_cache_dir)
    # Compile the update for batch shapes a run is likely to need next (a larger batch; a smaller one that keeps
    # being padded into a larger shape) in a background thread, so that no step waits for a compilation it could
    # have had ahead. false: compile each new shape when a batch first needs it.
    ahead: bool = True


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
    # How long the driver waits for one call to the trainer's processes (a step, a sync, a checkpoint, an
    # evaluation; a pass over a dataset, for each of its batches) before it stops the group as hung.
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
    compile: CompileConfig = Field(default_factory=CompileConfig)

    def check_at_load(self, source: str) -> None:
        """What loading a user's config checks beyond its schema (`core.config_loader.load_config`; never when a
        config is read back from a run directory): every local path it names exists (a Hub id is resolved when the
        run starts)."""
        from core.hf.hub import looks_like_hub_id

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
