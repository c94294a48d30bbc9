"""The native JAX sampler: batched prefill, then KV-cache decode under one `jax.jit`.

    sampler = JaxSampler(model, tokenizer_dir, mesh=mesh, max_model_len=1024)
    completions = sampler.generate(["Calculate 2 + 3."], SamplingParams(temperature=0.0, max_tokens=16))

Prompts of different lengths are right-padded into one batch; the KV cache's
slot index is the token position, so each row decodes at its own position and
padding slots are overwritten before any query can see them. Each prompt is
prefilled once and its `n` samples decode from copies of its cache. Sampling applies
temperature, then top-k, then top-p (the vLLM order), and the returned
log-probs are those of the distribution actually sampled. Prompt count and prompt
length are bucketed to powers of two, and a shape already compiled is reused when
the batch fits in it at no more than twice its own bucket (`core.shapes.SizeCache`),
to bound recompilation. On a mesh with a `tensor` axis the model runs
tensor-parallel (parameters sharded by their logical axes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from core.distributed import CompiledTogether, to_host
from core.models import state_mismatches
from core.models.decoder import Decoder
from core.shapes import SizeCache
from rollout.sampler import (
    Completion,
    Prompt,
    SamplingParams,
    apply_stop_strings,
    check_prompt_lengths,
    encode_prompts,
    sample_seeds,
)


def process_logits(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Logits [B, V] of the distribution sampled from: / temperature, top-k, top-p (masked to -inf)."""
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly above each token
        keep_sorted = before < top_p  # the smallest prefix reaching top_p (always the first token)
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample_token(logits: jax.Array, keys: jax.Array, temperature: float, top_k: int, top_p: float):
    """(token [B], log-prob [B]), row b drawn with its own key `keys[b]`. Temperature 0 is greedy with the
    model's own log-probs."""
    if temperature == 0.0:
        logp = jax.nn.log_softmax(logits, axis=-1)
        tok = jnp.argmax(logits, axis=-1)
    else:
        processed = process_logits(logits, temperature, top_k, top_p)
        logp = jax.nn.log_softmax(processed, axis=-1)
        tok = jax.vmap(jax.random.categorical)(keys, processed)
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


@partial(
    jax.jit, static_argnames=("graphdef", "n", "max_new", "cache_len", "temperature", "top_k", "top_p", "stop_ids")
)
def _generate(graphdef, params, prompts, lengths, seeds, *, n, max_new, cache_len, temperature, top_k, top_p, stop_ids):
    """prompts [Bp, P] right-padded, lengths [Bp], seeds [Bp * n] (one per sample) -> n completions of each,
    prompt-major rows B = Bp * n: (tokens [B, max_new], logprobs, n_generated [B], stopped [B], routes). Routes, for
    a mixture-of-experts model (else None): the experts each prompt token ([B, P, sparse layers, k]) and each
    sampled token ([B, max_new, sparse layers, k]) was routed to when it went through the model (routing replay).
    Row b's token t is drawn with key fold_in(key(seeds[b]), t): its own stream, whatever else is batched."""
    model: Decoder = nnx.merge(graphdef, params)
    bp, p = prompts.shape
    cache_k, cache_v = model.init_cache(bp, cache_len)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (bp, p))
    hidden, cache_k, cache_v, prompt_routes = model.with_cache(prompts, positions, cache_k, cache_v)
    last = hidden[jnp.arange(bp), lengths - 1][:, None]  # [Bp, 1, D]
    logits = model.logits(last)[:, 0]
    # Each prompt is prefilled once; its n samples start from copies of its cache (vLLM shares the prefix).
    b = bp * n
    logits, lengths = jnp.repeat(logits, n, axis=0), jnp.repeat(lengths, n, axis=0)
    cache_k, cache_v = jnp.repeat(cache_k, n, axis=1), jnp.repeat(cache_v, n, axis=1)  # [L, B, S, K, H]
    moe = prompt_routes is not None
    if moe:
        prompt_routes = jnp.repeat(prompt_routes, n, axis=0)
        routes = jnp.full((b, max_new, *prompt_routes.shape[2:]), -1, jnp.int32)
    else:
        routes = jnp.zeros((b, 0), jnp.int32)  # a dense model routes nothing
    stop = jnp.asarray(stop_ids, jnp.int32) if stop_ids else jnp.zeros((0,), jnp.int32)

    def cond(carry):
        t, done = carry[0], carry[3]
        return (t < max_new) & ~done.all()

    row_keys = jax.vmap(jax.random.key)(seeds)

    def body(carry):
        t, logits, tokens, done, n_gen, logps, cache_k, cache_v, routes = carry
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
        tok, lp = sample_token(logits, step_keys, temperature, top_k, top_p)
        tok = jnp.where(done, 0, tok)
        tokens = tokens.at[:, t].set(tok)
        logps = logps.at[:, t].set(jnp.where(done, 0.0, lp))
        n_gen = n_gen + (~done).astype(jnp.int32)
        was_done = done  # rows finished before this step: their token is padding
        done = done | (tok[:, None] == stop[None, :]).any(axis=-1)
        hidden, cache_k, cache_v, fed = model.with_cache(tok[:, None], (lengths + t)[:, None], cache_k, cache_v)
        if moe:  # the experts the sampled token went to, as it was fed back in
            routes = routes.at[:, t].set(jnp.where(was_done[:, None, None], -1, fed[:, 0]))
        logits = model.logits(hidden)[:, 0]
        return t + 1, logits, tokens, done, n_gen, logps, cache_k, cache_v, routes

    init = (
        jnp.int32(0),
        logits,
        jnp.zeros((b, max_new), jnp.int32),
        jnp.zeros((b,), bool),
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b, max_new), jnp.float32),
        cache_k,
        cache_v,
        routes,
    )
    _, _, tokens, done, n_gen, logps, _, _, routes = jax.lax.while_loop(cond, body, init)
    return tokens, logps, n_gen, done, (prompt_routes, routes) if moe else None


# In a trainer process group every process generates (SFT's held-out samples): they compile it, then run it, together.
_generate_together = CompiledTogether(_generate, "generation")


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


class JaxSampler:
    """Generation on the core model, on its own mesh (single-controller mode); a `rollout.sampler.Sampler`."""

    remote = False

    def __init__(
        self,
        model: Decoder,
        tokenizer_dir: str,
        *,
        mesh: Mesh | None = None,
        max_model_len: int = 1024,
        seed: int = 0,
    ):
        from core.tokenizer import open_tokenizer

        self.graphdef, self.params = nnx.split(model)
        self.model_cfg = model.cfg
        self.mesh = mesh
        self.max_model_len = max_model_len
        self.tokenizer = open_tokenizer(tokenizer_dir)
        self.eos_ids = tuple(sorted({self.tokenizer.eos_token_id} - {None}))
        self.policy_version = 0
        self._rng = np.random.default_rng(seed)  # seeds of unseeded requests
        self._counts = SizeCache(_bucket)  # prompts per batch, then prompt length: shapes compiled so far
        self._lengths = SizeCache(lambda n: _bucket(n, 8))

    # ---------------------------------------------------------------- generate

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        check_prompt_lengths(prompt_ids, params.max_tokens, self.max_model_len)
        rows = [ids for ids in prompt_ids for _ in range(params.n)]
        b, p = self._counts.pick(len(prompt_ids)), self._lengths.pick(max(len(r) for r in prompt_ids))
        tokens = np.zeros((b, p), np.int32)
        lengths = np.ones((b,), np.int32)
        for i, ids in enumerate(prompt_ids):
            tokens[i, : len(ids)] = ids
            lengths[i] = len(ids)
        per_prompt = sample_seeds(params, len(prompt_ids))
        if per_prompt is None:  # unseeded: the next draws of this sampler's own stream
            per_prompt = self._rng.integers(0, 2**31, (len(prompt_ids), params.n)).tolist()
        seeds = np.zeros((b * params.n,), np.uint32)  # padding prompts' rows keep seed 0
        seeds[: len(rows)] = np.asarray(per_prompt, np.uint32).reshape(-1)
        stop_ids = tuple(sorted(set(self.eos_ids) | set(params.stop_token_ids)))
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            out, logps, n_gen, stopped, routes = _generate_together(
                self.graphdef,
                self.params,
                jnp.asarray(tokens),
                jnp.asarray(lengths),
                jnp.asarray(seeds),
                n=params.n,
                max_new=params.max_tokens,
                cache_len=p + params.max_tokens,
                temperature=float(params.temperature),
                top_k=int(params.top_k),
                top_p=float(params.top_p),
                stop_ids=stop_ids,
            )
        out, logps, n_gen, stopped, routes = to_host((out, logps, n_gen, stopped, routes))  # collective in a group
        completions = [
            self._completion(rows[i], out[i, : n_gen[i]], logps[i, : n_gen[i]], bool(stopped[i]), params)
            for i in range(len(rows))
        ]
        if routes is not None:  # a mixture of experts: each token's experts, for routing replay
            prompt_routes, sampled_routes = routes
            for i, c in enumerate(completions):
                c.routes = np.concatenate(
                    [prompt_routes[i, : len(c.prompt_ids)], sampled_routes[i, : len(c.token_ids)]], axis=0
                )
        return completions

    def draw_seed(self) -> int:
        """A seed for an unseeded sample: the next draw of this sampler's own stream."""
        return int(self._rng.integers(0, 2**31))

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """Generates now (in this process): the ticket is the completions."""
        return self.generate(prompts, params)

    def result(self, ticket: list[Completion]) -> list[Completion]:
        return ticket

    def stop(self) -> None:
        """Nothing to release: the parameters are the trainer's to free."""

    def node_alive(self) -> bool:
        return True  # it runs in this process

    def _completion(self, prompt, tokens, logps, stopped, params) -> Completion:
        ids = [int(t) for t in tokens]
        ids, text, hit = apply_stop_strings(self.tokenizer, ids, params.stop)
        return Completion(
            prompt_ids=list(prompt),
            token_ids=ids,
            logprobs=[float(x) for x in logps[: len(ids)]] if params.logprobs else None,
            finish_reason="stop" if (stopped or hit) else "length",
            text=text,
            policy_version=self.policy_version,
        )

    # ----------------------------------------------------------------- weights

    def update_weights(self, params: nnx.State, version: int | None = None) -> None:
        """Swap in new parameters (already placed, e.g. by `rollout.weight_sync`).

        The new state must match the current one tensor for tensor (path, shape,
        dtype); otherwise nothing changes and the error lists the differences.
        """
        problems = state_mismatches(self.params, params)
        if problems:
            raise ValueError(
                "update_weights: new weights do not match the sampler's model; "
                "keeping the previous weights:\n  " + "\n  ".join(problems)
            )
        self.params = params
        self.policy_version = self.policy_version + 1 if version is None else version
