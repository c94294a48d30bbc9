"""A vLLM sampler in its own Ray actor (one engine per process), and the client that drives it.

    sampler = RemoteVLLMSampler.start("runs/x/hf", cfg.rollout)
    completions = sampler.generate(prompts, SamplingParams(...))
    sampler.update_weights(chunks)        # iterable of chunks of core.hf.pieces.TensorPiece, via the object store
    sampler.send_pieces(chunks, tag); sampler.commit_weights(tag, version)   # the same from several senders
    ref = sampler.submit_turns(turns, slice_s); progress = sampler.result(ref)   # episodes' turns (rollout/turns.py)
    sampler.shutdown()

vLLM keeps process-global state (its distributed groups), so each engine gets
its own process: a Ray actor running `VLLMSampler` in-process. Weight chunks
travel through the Ray object store and are read zero-copy on the receiving
side, then copied into receive buffers that persist between syncs; each
trainer process sends the pieces its own devices hold, straight to the actor. Every call
has a timeout, so a dead or wedged actor surfaces as an error instead of a hang.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from core.config import LoraConfig
from core.hf.pieces import TensorPiece
from rollout.config import RolloutConfig
from rollout.sampler import Completion, Prompt, SamplingParams
from rollout.turns import TurnRequest


class RemoteVLLMSampler:
    remote = True  # a `rollout.sampler.Sampler` on a Ray actor
    """Client side of a `VLLMSampler` running in a Ray actor; implements the Sampler protocol."""

    def __init__(self, handle, timeout_s: float):
        self.handle = handle
        self.timeout_s = timeout_s
        self.policy_version = 0
        self.last_sync: dict = {}
        self.node_id = ""  # the Ray node it runs on

    @classmethod
    def start(
        cls,
        model_dir: str,
        cfg: RolloutConfig,
        seed: int = 0,
        num_cpus: float = 0,
        timeout_s: float = 600.0,
        scheduling_strategy=None,
        adapter: LoraConfig | None = None,
    ) -> RemoteVLLMSampler:
        import ray

        from rollout.ray import ensure_ray
        from rollout.vllm_sampler import VLLMSampler

        ensure_ray()
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        actor = (
            ray.remote(VLLMSampler)
            .options(
                num_cpus=num_cpus,
                runtime_env={"env_vars": env},
                max_concurrency=1,
                scheduling_strategy=scheduling_strategy,
            )
            .remote(model_dir, cfg, seed, adapter)
        )
        client = cls(actor, timeout_s)
        client.node_id = client._get(actor.node_id.remote())  # type: ignore[attr-defined]  # start-up errors here
        return client

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self.result(self.submit(prompts, params))

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams):
        """Start generating; `result(ref)` waits for the completions (calls run in submission order)."""
        return self.handle.generate.remote(list(prompts), params)

    def result(self, ref) -> Any:
        """What a `submit` (its completions) or `submit_turns` (a `TurnProgress`) call returned."""
        return self._get(ref)

    def submit_turns(self, requests: Sequence[TurnRequest], slice_s: float):
        """Start `VLLMSampler.advance`: add turn requests to those the engine runs and decode until some finish."""
        return self.handle.advance.remote(list(requests), slice_s)

    def send_pieces(self, chunks: Iterable[Sequence[TensorPiece]], tag: str) -> dict:
        """Stream chunks of tensor pieces (`core.hf.pieces`) into the actor's receive buffers for update `tag`, one
        chunk in flight at a time (what a trainer process holds, from that process: several may send to one
        sampler, in any order)."""
        import ray

        nbytes, prepare, transfer = 0, 0.0, 0.0
        iterator = iter(chunks)
        while True:
            t0 = time.perf_counter()
            chunk = next(iterator, None)  # reading the shards and casting happen in the producer
            t1 = time.perf_counter()
            prepare += t1 - t0
            if chunk is None:
                break
            nbytes += self._get(self.handle.receive_pieces.remote(ray.put(list(chunk)), tag))
            transfer += time.perf_counter() - t1
        return {"bytes": nbytes, "prepare_s": prepare, "transfer_s": transfer}

    def commit_weights(self, tag: str, version: int | None = None) -> dict:
        """Load update `tag` in the engine (all of it arrived, or nothing changes); this client's policy version."""
        start = time.perf_counter()
        version = self.policy_version + 1 if version is None else version
        self._get(self.handle.commit_weights.remote(tag, version))
        self.policy_version = version
        return {"commit_s": time.perf_counter() - start}

    def load_adapter(self, tensors: dict, config: dict, version: int | None = None) -> dict:
        """The policy's LoRA adapters into the actor's engine (`VLLMSampler.load_adapter`), through the object
        store; this client's policy version."""
        import ray

        start = time.perf_counter()
        version = self.policy_version + 1 if version is None else version
        info = self._get(self.handle.load_adapter.remote(ray.put(tensors), config, version))
        self.policy_version = version
        self.last_sync = {**info, "seconds": time.perf_counter() - start, "version": version}
        return self.last_sync

    def update_weights(self, chunks: Iterable[Sequence[TensorPiece]], version: int | None = None) -> dict:
        """`send_pieces` then `commit_weights`, from one process."""
        start = time.perf_counter()
        tag = uuid.uuid4().hex
        info = self.send_pieces(chunks, tag)
        info.update(self.commit_weights(tag, version))
        self.last_sync = {**info, "seconds": time.perf_counter() - start, "version": self.policy_version}
        return self.last_sync

    def node_alive(self) -> bool:
        """Whether its Ray node is still alive in the cluster (False also when the cluster cannot be asked)."""
        from rollout.ray import node_alive

        return node_alive(self.node_id)

    def shutdown(self) -> None:
        import ray

        try:
            self._get(self.handle.shutdown.remote())
        finally:
            ray.kill(self.handle)

    def stop(self, grace_s: float = 10.0) -> None:
        """Shut the engine down if it answers within `grace_s` (frees its shared memory), then kill the actor;
        never raises (for a sampler that failed, or a cluster going away)."""
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.handle.shutdown.remote(), timeout=grace_s)
        with contextlib.suppress(Exception):
            ray.kill(self.handle)
