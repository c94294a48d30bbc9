"""Continuous batching on the JAX sampler: episodes' turns decode side by side in fixed slots, each turn returned as
soon as it stops, each episode's KV cache kept in its slot from one turn to the next.

    turns = SlotTurns(sampler, slots=32)             # a rollout.turns.Turns, for rollout.episodes.run_episodes
    turns.put([TurnRequest(key, token_ids, params)])
    done = turns.take()                              # [(key, Completion)]: the turns that stopped, at least one

Every slot holds one sequence's keys and values (`[layers, slots + 1, width, kv heads, head dim]`, the last slot a
scratch one that padding rows write to). Programs compiled once for the engine's sizes, whatever the prompts and
turns, run them (`rollout.engine_programs`): `prefill` writes up to `chunk` new tokens of up to `prefill_rows` slots
at a time (a turn's new tokens: the whole prompt of a new episode, once for the episodes that start from the same
prompt, copied to the others' slots; the environment's answer of an episode whose earlier turns the slot still
holds: its cache is reused, never computed again), and `decode` samples up to `decode_steps` tokens in every slot
with a turn in flight. A decode step reads every slot's whole width, so the caches start narrow (`WIDTH`
positions) and widen when a slot needs more, the wider programs compiled ahead in the background once a slot needs
three quarters of the width. Between two
decode calls the finished turns go back to the episodes (`take`), whose next turns join the slots at the next call
while the others decode on: no turn waits for the slowest of a round, as vLLM's continuous batching does it on the
engines (`rollout.turns.EngineTurns`).

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rollout.engine_programs import EnginePrograms, copy_slots, decode, prefill, widen
from rollout.jax_sampler import JaxSampler
from rollout.sampler import Completion, SamplingParams, apply_stop_strings, sample_seeds
from rollout.turns import TurnRequest

WIDTH = 256  # the caches' first width (positions a slot); they double, to at most the model length, when needed


@dataclasses.dataclass
class _Slot:
    """What a slot holds (host side): the tokens in its cache, the turn decoding in it, and when it was last used."""

    cached: list[int] = dataclasses.field(default_factory=list)
    owner: int | None = None  # the episode key whose tokens it holds
    turn: TurnRequest | None = None  # the turn decoding in it
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    last_used: int = 0
    seed: int = 0  # the turn's sampling seed, drawn once when it is admitted


class SlotTurns:
    """`rollout.turns.Turns` on a `JaxSampler`: continuous batching over `slots` slots (module docstring).
    `decode_steps`: tokens each slot decodes between two looks at what finished; `chunk`, `prefill_rows`: the
    prefill program's new tokens a row and rows a call; `programs`: the compiled programs, shared by a run's
    engines (default: this engine's own); `width`: the caches' first width."""

    def __init__(
        self,
        sampler: JaxSampler,
        slots: int,
        decode_steps: int = 8,
        chunk: int = 64,
        prefill_rows: int = 4,
        programs: EnginePrograms | None = None,
        width: int = WIDTH,
    ):
        self.sampler, self.slots = sampler, slots
        self.decode_steps, self.chunk, self.prefill_rows = decode_steps, chunk, prefill_rows
        self.programs = programs or EnginePrograms()
        self.max_len = sampler.max_model_len
        # The last width holds a turn ending at the model's length plus one call's decode steps or prefill chunk.
        self.widths = _widths(width, self.max_len + max(chunk, decode_steps + 1))
        self.queue: deque[TurnRequest] = deque()
        self.state = [_Slot() for _ in range(slots)]
        self.home: dict[int, int] = {}  # episode key -> its slot
        self.kind: tuple | None = None  # (temperature, top_k, top_p, stop ids): one per engine
        self._clock = 0
        self.prefilled = 0  # tokens written into the caches by prefill (what a reused or shared cache saves)
        self._params: Any = None  # the weights the caches were computed with
        self._device: tuple | None = None  # cache_k, cache_v, logits
        mesh = sampler.mesh
        self._placement = None if mesh is None else NamedSharding(mesh, PartitionSpec())

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

    # ------------------------------------------------------------------ device state

    def _kind(self, p: SamplingParams) -> tuple:
        stops = tuple(sorted(set(self.sampler.eos_ids) | set(p.stop_token_ids)))
        return (float(p.temperature), int(p.top_k), float(p.top_p), stops)

    def _put(self, x: np.ndarray) -> Any:
        return jax.device_put(x, self._placement) if self._placement is not None else jnp.asarray(x)

    def _arrays(self) -> tuple:
        """The engine's caches and logits (created at the first width, again when the weights changed: every cache
        is stale then), and the wider programs compiled ahead."""
        if self._params is not self.sampler.params or self._device is None:
            if any(slot.turn is not None for slot in self.state):
                raise RuntimeError("the sampler's weights changed while turns were decoding on the old ones")
            cfg = self.sampler.model_cfg
            shape = (cfg.num_layers, self.slots + 1, self.widths[0], cfg.num_kv_heads, cfg.resolved_head_dim)
            dtype = jnp.dtype(cfg.dtype)
            self._device = (
                self._put(np.zeros(shape, dtype)),
                self._put(np.zeros(shape, dtype)),
                self._put(np.zeros((self.slots + 1, cfg.vocab_size), np.float32)),
            )
            self._params = self.sampler.params
            for slot in self.state:
                slot.cached, slot.owner = [], None
            self.home.clear()
        return self._device

    def _compile_wider(self) -> None:
        """The programs of the next wider cache, compiled in the background while this width's run. (The decode
        program's sampling settings are the first turn's: an engine samples alike.)"""
        cache_k, _, logits = self._device  # type: ignore[misc]
        params = self.sampler.params
        for narrow, wide in zip(self.widths, self.widths[1:], strict=False):
            if narrow != cache_k.shape[2]:
                continue
            shape = lambda width: jax.ShapeDtypeStruct(
                (*cache_k.shape[:2], width, *cache_k.shape[3:]), cache_k.dtype, sharding=cache_k.sharding
            )
            self.programs.ahead(widen, {"width": wide}, shape(narrow), shape(narrow))
            caches = (shape(wide), shape(wide), logits)
            self.programs.ahead(
                prefill, {"graphdef": self.sampler.graphdef}, params, *caches, *self._prefill_inputs([])
            )
            self.programs.ahead(decode, self._decode_statics(), params, *caches, *self._decode_inputs())

    def _widen_to(self, needed: int) -> None:
        """Caches of at least `needed` positions a slot; once a slot needs three quarters of the width, the next
        width's programs are compiled ahead (a run whose episodes stay short never compiles them)."""
        cache_k, cache_v, logits = self._device  # type: ignore[misc]
        width = cache_k.shape[2]
        if needed <= width:
            if 4 * needed > 3 * width:
                self._compile_wider()
            return
        wide = next(w for w in self.widths if w >= needed)
        cache_k, cache_v = self.programs(widen, {"width": wide}, cache_k, cache_v)
        self._device = (cache_k, cache_v, logits)

    # ------------------------------------------------------------------ slots

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
        """Queued turns into slots: each slot's new tokens (what its cache does not hold yet) prefilled; a fresh slot
        whose tokens another fresh slot of this call also starts from gets a copy of that one's cache instead."""
        self._arrays()
        rows: list[tuple[int, list[int], int]] = []  # (slot, new tokens, start)
        copies: list[tuple[int, int]] = []  # (source slot, target slot)
        fresh: dict[tuple[int, ...], int] = {}  # tokens -> the fresh slot prefilling them in this call
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
            if not slot.cached and tuple(ids) in fresh:
                copies.append((fresh[tuple(ids)], index))
            else:
                new = ids[len(slot.cached) :]  # none: the slot's logits already follow its last token
                if not slot.cached:
                    fresh[tuple(ids)] = index
                self.prefilled += len(new)
                for start in range(0, len(new), self.chunk):
                    rows.append((index, new[start : start + self.chunk], len(slot.cached) + start))
            slot.cached = ids
            slot.turn, slot.tokens, slot.logprobs, slot.seed = request, [], [], self._seed(request)
            self._clock += 1
            slot.last_used = self._clock
        if rows:
            self._widen_to(max(start for _, _, start in rows) + self.chunk)
        self._prefill(rows)
        for i in range(0, len(copies), self.prefill_rows):
            part = copies[i : i + self.prefill_rows]
            pairs = np.full((2, self.prefill_rows), self.slots, np.int32)  # padding pairs: the scratch slot
            pairs[:, : len(part)] = np.asarray(part, np.int32).T
            self._device = self.programs(copy_slots, {}, *self._device, self._put(pairs[0]), self._put(pairs[1]))  # type: ignore[misc]

    def _prefill_inputs(self, batch: list[tuple[int, list[int], int]]) -> list[Any]:
        tokens = np.zeros((self.prefill_rows, self.chunk), np.int32)
        starts = np.zeros((self.prefill_rows,), np.int32)
        lengths = np.zeros((self.prefill_rows,), np.int32)
        slots = np.full((self.prefill_rows,), self.slots, np.int32)  # padding rows: the scratch slot
        for i, (index, ids, start) in enumerate(batch):
            tokens[i, : len(ids)], starts[i], lengths[i], slots[i] = ids, start, len(ids), index
        return [self._put(x) for x in (tokens, starts, lengths, slots)]

    def _prefill(self, rows: list[tuple[int, list[int], int]]) -> None:
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
            statics = {"graphdef": self.sampler.graphdef}
            with self._mesh():
                self._device = self.programs(
                    prefill, statics, self.sampler.params, *self._device, *self._prefill_inputs(batch)
                )  # type: ignore[misc]

    # ------------------------------------------------------------------ decode

    def _decode_statics(self) -> dict:
        temperature, top_k, top_p, stop_ids = self.kind or (1.0, -1, 1.0, ())
        return {
            "graphdef": self.sampler.graphdef,
            "steps": self.decode_steps,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "stop_ids": stop_ids,
        }

    def _decode_inputs(self) -> list[Any]:
        s = self.slots + 1
        # Every slot feeds a token each step: an idle one at its next free position, which its next write
        # overwrites before anything reads it (a query sees positions up to its own only).
        lengths = np.array([len(slot.cached) for slot in self.state] + [0], np.int32)
        done, count = np.ones((s,), bool), np.zeros((s,), np.int32)
        limits, seeds = np.ones((s,), np.int32), np.zeros((s,), np.uint32)
        for i, slot in enumerate(self.state):
            if slot.turn is not None:
                done[i], count[i] = False, len(slot.tokens)
                limits[i], seeds[i] = slot.turn.params.max_tokens, slot.seed
        return [self._put(x) for x in (lengths, done, count, limits, seeds)]

    def _decode(self) -> list[tuple[int, Completion]]:
        active = [slot for slot in self.state if slot.turn is not None]
        self._widen_to(max(len(slot.cached) for slot in active) + self.decode_steps + 1)
        with self._mesh():
            cache_k, cache_v, logits, tokens, logps, _, count = self.programs(
                decode,
                self._decode_statics(),
                self.sampler.params,
                *self._device,
                *self._decode_inputs(),  # type: ignore[misc]
            )
        self._device = (cache_k, cache_v, logits)
        tokens, logps, count = jax.device_get((tokens, logps, count))
        out = []
        for i, slot in enumerate(self.state):
            if slot.turn is None:
                continue
            n = int(count[i]) - len(slot.tokens)  # sampled in this call (and fed back: now in its cache)
            new = tokens[i, :n].tolist()
            slot.tokens += new
            slot.logprobs += logps[i, :n].tolist()
            slot.cached = slot.cached + new
            stopped = bool(new) and new[-1] in self.kind[3]  # type: ignore[index]
            if stopped or len(slot.tokens) >= slot.turn.params.max_tokens:
                out.append((slot.turn.key, self._completion(slot, stopped)))
                slot.turn = None
        return out

    def _seed(self, turn: TurnRequest) -> int:
        """The turn's sampling seed: the one `JaxSampler.generate` draws its single sample with."""
        seeds = sample_seeds(turn.params, 1)
        if seeds is None:  # unseeded: the sampler's own stream
            return self.sampler.draw_seed()
        return int(np.uint32(seeds[0][0]))

    def _completion(self, slot: _Slot, stopped: bool) -> Completion:
        turn = slot.turn
        assert turn is not None
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


def _widths(width: int, most: int) -> list[int]:
    """The caches' widths: `width` doubled up to `most` (the model length and a prefill chunk), which is the last;
    a width within a quarter of `most` is left out (its programs would save little)."""
    widths = []
    while width * 5 // 4 < most:
        widths.append(width)
        width *= 2
    return [*widths, most]
