"""The sampler protocol shared by the native JAX sampler and the vLLM sampler.

    completions = sampler.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=128))
    sampler.update_weights(...)   # new policy weights, in place; bumps `policy_version`

A prompt is a list of token ids, a string, or a chat (a list of
`{"role", "content"}` messages, rendered with the tokenizer's chat template
and a generation prompt). `generate` returns `n` completions per prompt,
prompt-major.

Seeds: with `SamplingParams.seed` set, sample j of prompt i draws its noise
from its own seed, `sample_seed(seed, prompt_offset + i, j)`, so no two
samples of a request share a random stream (samples of different prompts, or
of one request and the next, would otherwise be correlated), a sample does not
depend on which sampler of a group drew it or on what else was in its batch,
and the same request gives the same samples again.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

import numpy as np

Prompt = Sequence[int] | str | Sequence[dict]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the request's seed; None: unseeded
    logprobs: bool = True
    # Index of prompts[0] in the whole request (a sampler group hands each sampler a slice): seeds per sample
    # are keyed on the prompt's index in the request, not in the slice.
    prompt_offset: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    # log p(token) under the distribution actually sampled (after temperature, top-k, top-p)
    logprobs: list[float] | None
    finish_reason: Literal["stop", "length"]
    text: str
    policy_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Per token of token_ids: sampled by the model (True) or written by an environment (False: context, no loss);
    # None: every token was sampled (a single-turn completion).
    sampled: list[bool] | None = None
    # A mixture-of-experts model's routing, for routing replay: the experts each token of prompt_ids + token_ids
    # went to in each sparse layer when the sampler ran it, [tokens, sparse layers, k] int32; None: not recorded.
    routes: np.ndarray | None = None

    def record(self) -> dict[str, Any]:
        """Its fields as JSON values (a checkpoint's in-flight completions); `from_record` reads them back."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.routes is not None:  # int16 bytes in base64: a tenth of the JSON a list of numbers takes
            routes = np.asarray(self.routes)
            if routes.size and (routes.min() < -1 or routes.max() >= 2**15):
                raise ValueError(f"routes hold expert ids outside -1..32767: {routes.min()}..{routes.max()}")
            raw = base64.b64encode(routes.astype("<i2").tobytes()).decode()
            out["routes"] = {"shape": list(routes.shape), "int16": raw}
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Completion:
        routes = record.get("routes")
        if routes is not None:
            flat = np.frombuffer(base64.b64decode(routes["int16"]), "<i2")
            routes = flat.reshape(routes["shape"]).astype(np.int32)
        return cls(**{**record, "routes": routes})


def sample_seed(*keys: int) -> int:
    """A 31-bit seed mixed from integer keys (NumPy's SeedSequence hash): distinct keys give unrelated seeds,
    unlike `seed + index`, which makes request k's sample 1 and request k + 1's sample 0 the same stream."""
    return int(np.random.SeedSequence([int(k) % 2**63 for k in keys]).generate_state(1)[0] >> 1)


def sample_seeds(params: SamplingParams, num_prompts: int) -> list[list[int]] | None:
    """[prompt][sample] seeds of a request (None when it is unseeded)."""
    if params.seed is None:
        return None
    return [
        [sample_seed(params.seed, params.prompt_offset + i, j) for j in range(params.n)] for i in range(num_prompts)
    ]


class Sampler(Protocol):
    """What the RL loop needs of a sampler (`rollout.jax_sampler.JaxSampler`, `rollout.vllm_actor.RemoteVLLMSampler`).

    `remote` says where it runs and so how weights reach it: False, in the trainer's process (weights
    resharded as JAX arrays, `rollout.weight_sync.reshard_to_jax_sampler`); True, a Ray actor (weights
    streamed from each trainer process as pieces of tensors, `sync_to_vllm`; a failure of the actor can be met by
    restarting it, or by dropping it when its node left the cluster).
    """

    remote: bool
    policy_version: int

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]: ...

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> Any:
        """Start generating; `result(ticket)` returns the completions (a local sampler may finish here)."""
        ...

    def result(self, ticket: Any) -> list[Completion]: ...

    def update_weights(self, *args: Any, **kwargs: Any) -> Any: ...

    def stop(self) -> None:
        """Release the engine (a failed one may still hold its memory)."""
        ...

    def node_alive(self) -> bool:
        """Whether the node it runs on is still part of the cluster (one that left is not restarted on)."""
        ...


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids for every prompt, as training encodes prompts: a text with what the tokenizer puts in front of one
    (its BOS; `core.encoding.encode_prompt`), a chat rendered by its template with a generation prompt
    (`core.chat.chat_prompt_ids`), token ids as they are."""
    from core.chat import chat_prompt_ids
    from core.encoding import encode_prompt

    if not prompts:
        raise ValueError("generate() got an empty prompt list")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = encode_prompt(tokenizer, p)
        elif len(p) and isinstance(p[0], dict):
            ids = chat_prompt_ids(tokenizer, p)  # type: ignore[arg-type]
        else:
            ids = [int(t) for t in p]  # type: ignore[arg-type]  # token ids
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.append(list(ids))
    return out


def check_prompt_lengths(prompt_ids: Sequence[Sequence[int]], max_tokens: int, max_model_len: int) -> None:
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_tokens > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it needs "
                f"{len(ids) + max_tokens} > max_model_len={max_model_len}"
            )


def apply_stop_strings(tokenizer: Any, token_ids: list[int], stop: Sequence[str]) -> tuple[list[int], str, bool]:
    """Cut a completion at the first stop string: (tokens through the one completing it, text before it, hit)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if not stop or not any(s in text for s in stop):
        return token_ids, text, False
    for n in range(1, len(token_ids) + 1):
        prefix = tokenizer.decode(token_ids[:n], skip_special_tokens=True)
        hits = [prefix.find(s) for s in stop if s in prefix]
        if hits:
            return token_ids[:n], prefix[: min(hits)], True
    return token_ids, text, False
