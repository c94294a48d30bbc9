"""Continuous batching on the JAX sampler: episodes' turns decode side by side in fixed slots, each turn returned as
soon as it stops, each episode's KV cache kept in its slot from one turn to the next.

    turns = SlotTurns(sampler, slots=32)             # a rollout.turns.Turns, for rollout.episodes.run_episodes
    turns.put([TurnRequest(key, token_ids, params)])
    done = turns.take()                              # [(key, Completion)]: the turns that stopped, at least one

Every slot holds one sequence's keys and values (`[layers, slots + 1, positions, kv heads, head dim]`, the last slot
a scratch one that padding rows write to). Two programs run them, each compiled once for the engine's sizes, whatever
the prompts and turns: `_prefill` writes up to `chunk` new tokens of up to `prefill_rows` slots at a time (a turn's
new tokens: the whole prompt of a new episode; the environment's answer of an episode whose earlier turns the slot
still holds: its cache is reused, never computed again), and `_decode` samples up to `decode_steps` tokens in every
slot with a turn in flight. Between two decode calls the finished turns go back to the episodes (`take`), whose next
turns join the slots at the next call while the others decode on: no turn waits for the slowest of a round, as
vLLM's continuous batching does it on the engines (`rollout.turns.EngineTurns`).

Sampling is the JAX sampler's (`rollout.jax_sampler.sample_token`): temperature, top-k, top-p, the log-probs of the
distribution sampled, token t of a turn drawn with fold_in(key(seed), t) from the turn's own seed, so a turn samples
what `JaxSampler.generate` samples for the same request. A slot's cache is dropped when its episode's next turn does
not extend what it holds, when the weights change, and when a new episode needs the slot (the one idle longest).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout.jax_sampler import JaxSampler, sample_token
from rollout.sampler import Completion, SamplingParams, apply_stop_strings, sample_seeds
from rollout.turns import TurnRequest


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache_k", "cache_v", "logits"))
def _prefill(graphdef, params, cache_k, cache_v, logits, tokens, starts, lengths, slots):
    """Row i writes `lengths[i]` new tokens (`tokens[i, :lengths[i]]`, [N, C] right-padded) of slot `slots[i]` at
    positions starts[i].. into its cache, and sets that slot's next-token logits from its last new token. Padding
    rows (length 0) name the scratch slot."""
    model = nnx.merge(graphdef, params)
    n, c = tokens.shape
    positions = starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    k, v = cache_k[:, slots], cache_v[:, slots]  # [L, N, T, K, H]
    hidden, k, v, _ = model.with_cache(tokens, positions, k, v)
    last = hidden[jnp.arange(n), jnp.maximum(lengths - 1, 0)][:, None]  # [N, 1, D]
    new = model.logits(last)[:, 0]
    cache_k, cache_v = cache_k.at[:, slots].set(k), cache_v.at[:, slots].set(v)
    logits = logits.at[slots].set(jnp.where((lengths > 0)[:, None], new, logits[slots]))
    return cache_k, cache_v, logits


@partial(
    jax.jit,
    static_argnames=("graphdef", "steps", "temperature", "top_k", "top_p", "stop_ids"),
    donate_argnames=("cache_k", "cache_v", "logits"),
)
def _decode(
    graphdef, params, cache_k, cache_v, logits, lengths, done, count, limits, seeds, *, steps, temperature, top_k,
    top_p, stop_ids
):  # fmt: skip
    """Up to `steps` tokens in every slot not `done` (fewer once all are): [S, steps] tokens and log-probs, and each
    slot's state after them. A slot is done once it sampled a stop token or `limits` tokens; every token it samples
    is fed back (its cache holds it, and its logits are the next token's), so a turn's cache ends at its last
    token. Token `count[s]` of slot s's turn is drawn with fold_in(key(seeds[s]), count[s])."""
    model = nnx.merge(graphdef, params)
    s = logits.shape[0]
    stop = jnp.asarray(stop_ids, jnp.int32) if stop_ids else jnp.zeros((0,), jnp.int32)
    row_keys = jax.vmap(jax.random.key)(seeds)

    def cond(carry):
        return (carry[0] < steps) & ~carry[4].all()

    def body(carry):
        t, logits, tokens, logps, done, count, lengths, cache_k, cache_v = carry
        keys = jax.vmap(jax.random.fold_in)(row_keys, count)
        tok, lp = sample_token(logits, keys, temperature, top_k, top_p)
        live = ~done
        tokens = tokens.at[:, t].set(jnp.where(live, tok, 0))
        logps = logps.at[:, t].set(jnp.where(live, lp, 0.0))
        count = count + live
        done = done | (live & ((tok[:, None] == stop[None, :]).any(axis=-1) | (count >= limits)))
        hidden, cache_k, cache_v, _ = model.with_cache(tok[:, None], lengths[:, None], cache_k, cache_v)
        logits = jnp.where(live[:, None], model.logits(hidden)[:, 0], logits)
        lengths = lengths + live
        return t + 1, logits, tokens, logps, done, count, lengths, cache_k, cache_v

    init = (
        jnp.int32(0),
        logits,
        jnp.zeros((s, steps), jnp.int32),
        jnp.zeros((s, steps), jnp.float32),
        done,
        count,
        lengths,
        cache_k,
        cache_v,
    )
    t, logits, tokens, logps, done, count, lengths, cache_k, cache_v = jax.lax.while_loop(cond, body, init)
    return cache_k, cache_v, logits, tokens, logps, done, count, lengths, t


@dataclasses.dataclass
class _Slot:
    """What a slot holds (host side): the tokens in its cache, the turn decoding in it, and when it was last used."""

    cached: list[int] = dataclasses.field(default_factory=list)
    owner: int | None = None  # the episode key whose tokens it holds
    turn: TurnRequest | None = None  # the turn decoding in it
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    last_used: int = 0


class SlotTurns:
    """`rollout.turns.Turns` on a `JaxSampler`: continuous batching over `slots` slots (module docstring).
    `decode_steps`: tokens each slot decodes between two looks at what finished; `chunk`, `prefill_rows`: the
    prefill program's new tokens a row and rows a call."""

    def __init__(self, sampler: JaxSampler, slots: int, decode_steps: int = 8, chunk: int = 64, prefill_rows: int = 4):
        self.sampler, self.slots = sampler, slots
        self.decode_steps, self.chunk, self.prefill_rows = decode_steps, chunk, prefill_rows
        self.max_len = sampler.max_model_len
        self.queue: deque[TurnRequest] = deque()
        self.state = [_Slot() for _ in range(slots)]
        self.home: dict[int, int] = {}  # episode key -> its slot
        self.kind: tuple | None = None  # (temperature, top_k, top_p, stop ids): one per engine
        self._clock = 0
        self.prefilled = 0  # tokens written into the caches by prefill (what a reused cache saves)
        self._params: Any = None  # the weights the caches were computed with
        self._device: tuple | None = None  # cache_k, cache_v, logits, lengths, done, count, limits, seeds

    # ------------------------------------------------------------------ Turns

    def put(self, requests: Sequence[TurnRequest]) -> None:
        for r in requests:
            if r.params.n != 1:
                raise ValueError(f"a turn samples one completion (episode {r.key} asked for n={r.params.n})")
            if len(r.token_ids) + r.params.max_tokens > self.max_len:
                raise ValueError(
                    f"episode {r.key}: {len(r.token_ids)} tokens + max_tokens={r.params.max_tokens} > "
                    f"max_model_len={self.max_len}"
                )
            kind = self._kind(r.params)
            if self.kind is None:
                self.kind = kind
            elif kind != self.kind:
                raise ValueError(f"turns of one engine sample alike: {kind} after {self.kind}")
            self.queue.append(r)

    def take(self) -> list[tuple[int, Completion]]:
        out: list[tuple[int, Completion]] = []
        while not out:
            self._admit()
            if not any(s.turn is not None for s in self.state):
                return out  # nothing was put
            out = self._decode()
        return out

    # ------------------------------------------------------------------ host side

    def _kind(self, p: SamplingParams) -> tuple:
        stops = tuple(sorted(set(self.sampler.eos_ids) | set(p.stop_token_ids)))
        return (float(p.temperature), int(p.top_k), float(p.top_p), stops)

    def _arrays(self) -> tuple:
        """The engine's device state (created on first use, reset when the weights changed: every cache is stale)."""
        if self._params is not self.sampler.params or self._device is None:
            if any(slot.turn is not None for slot in self.state):
                raise RuntimeError("the sampler's weights changed while turns were decoding on the old ones")
            cfg = self.sampler.model_cfg
            model_dtype = jnp.dtype(cfg.dtype)
            shape = (cfg.num_layers, self.slots + 1, self.max_len + self.chunk, cfg.num_kv_heads, cfg.resolved_head_dim)
            zeros = lambda shape, dtype: jnp.zeros(shape, dtype)
            self._device = (
                zeros(shape, model_dtype),
                zeros(shape, model_dtype),
                zeros((self.slots + 1, cfg.vocab_size), jnp.float32),
            )
            self._params = self.sampler.params
            for slot in self.state:
                slot.cached, slot.owner = [], None
            self.home.clear()
        return self._device

    def _pick_slot(self, key: int) -> int | None:
        """The episode's own slot, else a free one, else the one idle longest (its cache dropped); None: all busy."""
        if key in self.home and self.state[self.home[key]].turn is None:
            return self.home[key]
        idle = [i for i, s in enumerate(self.state) if s.turn is None]
        if not idle:
            return None
        free = [i for i in idle if self.state[i].owner is None]
        index = free[0] if free else min(idle, key=lambda i: self.state[i].last_used)
        old = self.state[index].owner
        if old is not None:
            del self.home[old]
        self.state[index].cached, self.state[index].owner = [], key
        self.home[key] = index
        return index

    def _admit(self) -> None:
        """Queued turns into slots: each slot's new tokens (what its cache does not hold yet) prefilled."""
        cache_k, cache_v, logits = self._arrays()
        rows: list[tuple[int, list[int], int]] = []  # (slot, new tokens, start)
        while self.queue:
            index = self._pick_slot(self.queue[0].key)
            if index is None:
                break
            request = self.queue.popleft()
            slot = self.state[index]
            ids = list(request.token_ids)
            if not ids:
                raise ValueError(f"episode {request.key}: a turn needs at least one token of context")
            if ids[: len(slot.cached)] != slot.cached:  # not a continuation of what the slot holds: start again
                slot.cached = []
            new = ids[len(slot.cached) :]  # none: the slot's logits already follow its last token
            self.prefilled += len(new)
            for start in range(0, len(new), self.chunk):
                rows.append((index, new[start : start + self.chunk], len(slot.cached) + start))
            slot.cached = ids
            slot.turn, slot.tokens, slot.logprobs = request, [], []
            self._clock += 1
            slot.last_used = self._clock
        # Rows of one slot go in order, each call holding at most one row a slot (a later chunk attends to an earlier).
        while rows:
            batch: list[tuple[int, list[int], int]] = []
            rest, seen = [], set()
            for row in rows:
                if row[0] in seen or len(batch) == self.prefill_rows:
                    rest.append(row)
                else:
                    batch.append(row)
                    seen.add(row[0])
            rows = rest
            tokens = np.zeros((self.prefill_rows, self.chunk), np.int32)
            starts = np.zeros((self.prefill_rows,), np.int32)
            lengths = np.zeros((self.prefill_rows,), np.int32)
            slots = np.full((self.prefill_rows,), self.slots, np.int32)  # padding rows: the scratch slot
            for i, (index, ids, start) in enumerate(batch):
                tokens[i, : len(ids)], starts[i], lengths[i], slots[i] = ids, start, len(ids), index
            with self._mesh():
                cache_k, cache_v, logits = _prefill(
                    self.sampler.graphdef, self.sampler.params, cache_k, cache_v, logits, tokens, starts, lengths, slots
                )
        self._device = (cache_k, cache_v, logits)

    def _decode(self) -> list[tuple[int, Completion]]:
        cache_k, cache_v, logits = self._arrays()
        s = self.slots + 1
        # Every slot feeds a token each step: an idle one at its next free position, which its next write
        # overwrites before anything reads it (a query sees positions up to its own only).
        lengths = np.array([len(slot.cached) for slot in self.state] + [0], np.int32)
        done = np.ones((s,), bool)
        count = np.zeros((s,), np.int32)
        limits = np.ones((s,), np.int32)
        seeds = np.zeros((s,), np.uint32)
        for i, slot in enumerate(self.state):
            if slot.turn is None:
                continue
            done[i], count[i] = False, len(slot.tokens)
            limits[i] = slot.turn.params.max_tokens
            seeds[i] = self._seed(slot.turn)
        temperature, top_k, top_p, stop_ids = self.kind  # type: ignore[misc]
        with self._mesh():
            cache_k, cache_v, logits, tokens, logps, done_after, count_after, _, _ = _decode(
                self.sampler.graphdef,
                self.sampler.params,
                cache_k,
                cache_v,
                logits,
                lengths,
                done,
                count,
                limits,
                seeds,
                steps=self.decode_steps,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                stop_ids=stop_ids,
            )
        self._device = (cache_k, cache_v, logits)
        tokens, logps, done_after, count_after = jax.device_get((tokens, logps, done_after, count_after))
        out = []
        for i, slot in enumerate(self.state):
            if slot.turn is None:
                continue
            n = int(count_after[i]) - len(slot.tokens)  # sampled in this call (and fed back: now in its cache)
            slot.tokens += tokens[i, :n].tolist()
            slot.logprobs += logps[i, :n].tolist()
            slot.cached = slot.cached + tokens[i, :n].tolist()
            if done_after[i]:
                out.append((slot.turn.key, self._completion(slot)))
                slot.turn = None
        return out

    def _seed(self, turn: TurnRequest) -> int:
        """The turn's sampling seed: the one `JaxSampler.generate` draws its single sample with."""
        seeds = sample_seeds(turn.params, 1)
        if seeds is None:  # unseeded: the sampler's own stream
            return self.sampler.draw_seed()
        return int(np.uint32(seeds[0][0]))

    def _completion(self, slot: _Slot) -> Completion:
        turn = slot.turn
        assert turn is not None
        assert self.kind is not None
        stopped = bool(slot.tokens) and slot.tokens[-1] in self.kind[3]
        ids, text, hit = apply_stop_strings(self.sampler.tokenizer, slot.tokens, turn.params.stop)
        return Completion(
            prompt_ids=list(turn.token_ids),
            token_ids=ids,
            logprobs=slot.logprobs[: len(ids)] if turn.params.logprobs else None,
            finish_reason="stop" if (stopped or hit) else "length",
            text=text,
            policy_version=self.sampler.policy_version,
        )

    def _mesh(self):
        mesh = self.sampler.mesh
        return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
