"""Routing replay's routes from a vLLM engine on CPU: the experts each mixture-of-experts layer sent each token to.

    recorder = RouteRecorder(llm, served_model_config)    # an in-process `vllm.LLM`, started with enforce_eager
    outputs = llm.generate(...)
    routes = recorder.take(output.request_id, completion.index, num_tokens)   # [tokens, sparse layers, k] int32

vLLM 0.32 returns routes itself (`enable_return_routed_experts`) only with Model Runner V2, which needs Triton:
on this CPU it refuses to start. Its routers (`BaseRouter`) still call a capture callback with each forward pass's
top-k expert ids, so this records them in the sampler's own process: one callback per sparse layer keeps the step's
ids, and a wrapper around the model runner's forward writes them, after the pass, to the requests and positions the
step computed (the runner's request order, `query_start_loc` and the positions it passed the model).

What it needs of the engine, checked at start: the routers run as Python (`enforce_eager`: a compiled graph would
not call the callback), and every prompt token is computed (no prefix caching: a cached block's tokens are not run,
so their routes would be missing). A token no forward pass ran (a completion's last, sampled but never fed back)
gets -1: "not routed", which the trainer routes itself (`core.models.moe.replayed_routes`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.config import ModelConfig

# Rows a request's route buffer grows by (then doubles): most completions need one or two growths.
_FIRST_ROWS = 256


def scatter_step(
    store: dict[str, np.ndarray], req_ids: Sequence[str], starts: np.ndarray, positions: np.ndarray, step: np.ndarray
) -> None:
    """Write one forward pass's routes `step` [tokens, sparse layers, k] into `store` (request id -> [rows, sparse
    layers, k], -1 where not routed, grown as needed): the tokens starts[i]:starts[i + 1] are request req_ids[i]'s,
    at `positions` in its sequence. Rows past starts[-1] (padding) are dropped."""
    for i, rid in enumerate(req_ids):
        lo, hi = int(starts[i]), int(starts[i + 1])
        if hi == lo:
            continue
        pos = positions[lo:hi]
        buf = store.get(rid)
        need = int(pos.max()) + 1
        if buf is None or len(buf) < need:
            rows = max(need, _FIRST_ROWS, 2 * (0 if buf is None else len(buf)))
            grown = np.full((rows, *step.shape[1:]), -1, np.int16)
            if buf is not None:
                grown[: len(buf)] = buf
            store[rid] = buf = grown
        buf[pos] = step[lo:hi]


class RouteRecorder:
    """Records, in an in-process vLLM engine serving a mixture of experts, each request's routes (see the module)."""

    def __init__(self, llm: Any, served: ModelConfig):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        assert served.moe is not None
        config = llm.llm_engine.vllm_config
        if not config.model_config.enforce_eager:
            raise ValueError(
                "rollout.record_routes=true on CPU needs rollout.enforce_eager=true: vLLM's compiled graph does not "
                "call the routers' capture callback, where routes are recorded"
            )
        if config.cache_config.enable_prefix_caching:
            raise ValueError("recording routes needs prefix caching off: cached prompt tokens are not run")
        self.k = served.moe.experts_per_token
        sparse = [i for i, s in enumerate(served.sparse_layers) if s]
        self.runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.requests = llm.llm_engine.output_processor.request_states  # internal id -> state (external id, index)
        found: list[int] = []
        for module in self.runner.get_model().modules():
            if not isinstance(module, MoERunner):
                continue
            if not isinstance(module.router, BaseRouter):
                raise ValueError(f"vLLM's router {type(module.router).__name__} takes no capture callback")
            if module.layer_id not in sparse:
                raise ValueError(f"vLLM routes layer {module.layer_id}, which the checkpoint's config calls dense")
            module.router.set_capture_fn(functools.partial(self._capture, sparse.index(module.layer_id)))
            found.append(module.layer_id)
        if sorted(found) != sparse:
            raise ValueError(f"vLLM routes layers {sorted(found)}; the checkpoint's config has sparse layers {sparse}")
        self._step: list[np.ndarray | None] = [None] * len(sparse)
        self._routes: dict[str, np.ndarray] = {}  # internal request id -> [rows, sparse layers, k]
        self._keys: dict[tuple[str, int], str] = {}  # (external request id, completion index) -> internal id
        forward = self.runner._model_forward

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            self._step = [None] * len(sparse)
            out = forward(*args, **kwargs)
            positions = kwargs["positions"] if "positions" in kwargs else args[1]
            self._record(positions)
            return out

        self.runner._model_forward = recording_forward

    def _capture(self, column: int, topk_ids: Any) -> None:
        self._step[column] = topk_ids.detach().to("cpu").numpy().astype(np.int16)

    def _record(self, positions: Any) -> None:
        if any(s is None for s in self._step):  # a pass without the MoE layers (none in serving) records nothing
            return
        n = self.runner.input_batch.num_reqs
        req_ids = list(self.runner.input_batch.req_ids[:n])
        for rid in req_ids:
            if rid not in self._routes:
                state = self.requests.get(rid)
                if state is not None:
                    self._keys[(state.external_req_id, int(state.request_index))] = rid
        starts = self.runner.query_start_loc.np[: n + 1]
        step = np.stack([s[: starts[-1]] for s in self._step], axis=1)  # type: ignore[index]
        scatter_step(self._routes, req_ids, starts, positions.detach().to("cpu").numpy()[: starts[-1]], step)

    def take(self, request_id: str, index: int, num_tokens: int) -> np.ndarray:
        """The routes of completion `index` of request `request_id` (a `RequestOutput`'s) over its first `num_tokens`
        tokens (prompt and completion), [num_tokens, sparse layers, k] int32, -1 where no pass ran the token; the
        request's record is dropped. A completion nothing was recorded for is an error, not routes of -1 (which
        replay would read as "route it yourself")."""
        rid = self._keys.pop((request_id, index), None)
        buf = self._routes.pop(rid, None) if rid is not None else None
        if buf is None:
            raise RuntimeError(f"no routes were recorded for completion {index} of vLLM request {request_id!r}")
        out = np.full((num_tokens, len(self._step), self.k), -1, np.int32)
        rows = min(num_tokens, len(buf))
        out[:rows] = buf[:rows]
        return out

    def drop_finished(self) -> None:
        """Forget requests the engine no longer runs (aborted, or finished without `take`)."""
        live = set(self.requests)
        self._keys = {key: rid for key, rid in self._keys.items() if rid in live}
        self._routes = {rid: buf for rid, buf in self._routes.items() if rid in live}
