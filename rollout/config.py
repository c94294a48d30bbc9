"""`rollout.*`: how samplers generate (posttrain's on-policy methods; `rollout.vllm_sampler`, `rollout.jax_sampler`)."""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import Field, model_validator

from core.config import DType, MeshConfig, PlacementConfig, RunConfig, Section


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
    # vLLM serving a mixture of experts: return the experts each token was routed to (`Completion.routes`, for
    # routing replay). On CPU they are recorded in the sampler's process (`rollout.vllm_routes`: needs
    # enforce_eager, refused at the engine's start without it; turns prefix caching off); on a GPU they are vLLM's
    # own (`enable_return_routed_experts`). The JAX sampler always returns them.
    record_routes: bool = False
    # Cores for vLLM's OpenMP threads per sampler, e.g. "0" or "0-1"; None lets vLLM choose.
    omp_threads_bind: str | None = None
    reshard_chunk_bytes: int = Field(256 * 1024 * 1024, gt=0)
    # A policy with LoRA adapters (model.lora): `adapters` serves its base in vLLM with LoRA enabled and sends only
    # the adapters after each update; `merged` sends the whole model with the adapters merged into its weights
    # (for an engine without LoRA support, or a target it cannot adapt).
    lora_sync: Literal["adapters", "merged"] = "adapters"
    rollout_data_parallelism: int = Field(1, gt=0)  # vLLM sampler actors, each with the whole model
    sampler_timeout_s: float = Field(600.0, gt=0.0)  # a sampler call slower than this counts as dead

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


class SamplingJob(Protocol):
    """The sections of a job's config that placing and starting samplers reads (`rollout.placement`)."""

    @property
    def run(self) -> RunConfig: ...

    @property
    def mesh(self) -> MeshConfig: ...

    @property
    def rollout(self) -> RolloutConfig: ...

    @property
    def placement(self) -> PlacementConfig: ...
