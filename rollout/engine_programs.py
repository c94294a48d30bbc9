"""The JAX engine's programs (`rollout.jax_engine.SlotTurns`): prefill, decode, a copy of slots and a wider cache,
each compiled once for its sizes and kept as an executable (`EnginePrograms`), the wider caches' compiled ahead of
need in a background thread.

Shapes (S slots plus a scratch one, W positions a slot, the cache's width; L layers, K kv heads, H head dim):
cache_k, cache_v [L, S + 1, W, K, H]; logits [S + 1, V] (each slot's next-token logits).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from core.compile_ahead import BackgroundCompiler
from core.compile_cache import compile_clock
from rollout.jax_sampler import sample_token


def prefill(params, cache_k, cache_v, logits, tokens, starts, lengths, slots, *, graphdef):
    """Row i writes `lengths[i]` new tokens (`tokens[i, :lengths[i]]`, [N, C] right-padded) of slot `slots[i]` at
    positions starts[i].. into its cache and sets that slot's next-token logits from its last new token. Padding
    rows (length 0) name the scratch slot. Only the new positions are written back."""
    model = nnx.merge(graphdef, params)
    n, c = tokens.shape
    positions = starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None]  # [N, C]
    k, v = cache_k[:, slots], cache_v[:, slots]  # [L, N, W, K, H]
    hidden, k, v, _ = model.with_cache(tokens, positions, k, v)
    last = hidden[jnp.arange(n), jnp.maximum(lengths - 1, 0)][:, None]  # [N, 1, D]
    new = model.logits(last)[:, 0]
    rows = jnp.arange(n)[:, None]
    cache_k = cache_k.at[:, slots[:, None], positions].set(k[:, rows, positions])
    cache_v = cache_v.at[:, slots[:, None], positions].set(v[:, rows, positions])
    logits = logits.at[slots].set(jnp.where((lengths > 0)[:, None], new, logits[slots]))
    return cache_k, cache_v, logits


def decode(
    params, cache_k, cache_v, logits, lengths, done, count, limits, seeds, *, graphdef, steps, temperature, top_k,
    top_p, stop_ids
):  # fmt: skip
    """Up to `steps` tokens in every slot not `done` (fewer once all are): [S + 1, steps] tokens and log-probs, and
    each slot's state after them. A slot is done once it sampled a stop token or `limits` tokens; every token it
    samples is fed back (its cache holds it, its logits are the next token's), so a turn's cache ends at its last
    token. Token `count[s]` of slot s's turn is drawn with fold_in(key(seeds[s]), count[s]): `JaxSampler`'s
    stream for one request."""
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

    zeros = (jnp.zeros((s, steps), jnp.int32), jnp.zeros((s, steps), jnp.float32))
    init = (jnp.int32(0), logits, *zeros, done, count, lengths, cache_k, cache_v)
    _, logits, tokens, logps, done, count, _, cache_k, cache_v = jax.lax.while_loop(cond, body, init)
    return cache_k, cache_v, logits, tokens, logps, done, count


def copy_slots(cache_k, cache_v, logits, sources, targets):
    """Slot `sources[i]`'s cache and logits into slot `targets[i]` (an episode starting where another's identical
    prompt was prefilled); padding pairs name the scratch slot twice."""
    cache_k = cache_k.at[:, targets].set(cache_k[:, sources])
    cache_v = cache_v.at[:, targets].set(cache_v[:, sources])
    return cache_k, cache_v, logits.at[targets].set(logits[sources])


def widen(cache_k, cache_v, *, width):
    """The caches with `width` positions a slot (the new ones zero)."""
    pad = [(0, 0), (0, 0), (0, width - cache_k.shape[2]), (0, 0), (0, 0)]
    return jnp.pad(cache_k, pad), jnp.pad(cache_v, pad)


# What each program donates (its caches, its logits): updated in place.
_DONATE = {prefill: (1, 2, 3), decode: (1, 2, 3), copy_slots: (0, 1, 2), widen: ()}  # a wider cache is new memory


def _spec(x: Any) -> Any:
    """An argument's shape, dtype and placement: what a compiled program is keyed by and lowered from."""
    sharding = x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class EnginePrograms:
    """The engine's executables by program, static settings and argument shapes: each compiled once (in a run's
    first process that needs it; the persistent cache spares later ones), then called directly. `ahead` compiles
    a program for arguments a run will need later in the background thread (`core.compile_ahead`); a call that
    needs one still compiling waits for it (counted as compilation by `core.compile_cache`)."""

    def __init__(self) -> None:
        self._ready: dict[Any, Any] = {}
        self._pending: dict[Any, Future] = {}
        self._compiler = BackgroundCompiler("engine")

    def _key(self, fn: Callable, statics: dict, args: tuple) -> Any:
        specs = jax.tree.map(_spec, args)
        leaves, tree = jax.tree.flatten(specs)
        # Shapes and dtypes: the engine places every input alike (replicated on its mesh), and a sharding object
        # compares by identity, so keying on it would compile equal placements again.
        return (fn.__name__, tuple(sorted(statics.items())), tree, tuple((x.shape, str(x.dtype)) for x in leaves))

    def _compile(self, fn: Callable, statics: dict, args: tuple) -> Any:
        jitted = jax.jit(partial(fn, **statics), donate_argnums=_DONATE[fn])
        return jitted.lower(*jax.tree.map(_spec, args)).compile()

    def __call__(self, fn: Callable, statics: dict, *args: Any) -> Any:
        key = self._key(fn, statics, args)
        if key not in self._ready:
            if key in self._pending:
                start = time.perf_counter()
                try:
                    self._ready[key] = self._pending.pop(key).result()
                except Exception:  # compiled again here, where its error is raised
                    self._ready[key] = self._compile(fn, statics, args)
                compile_clock().add_wait(time.perf_counter() - start)
            else:
                self._ready[key] = self._compile(fn, statics, args)
        return self._ready[key](*args)

    def ahead(self, fn: Callable, statics: dict, *args: Any) -> None:
        """Compile `fn` for `args` (arrays or `jax.ShapeDtypeStruct`s) in the background, unless it is already."""
        key = self._key(fn, statics, args)
        if key not in self._ready and key not in self._pending:
            specs = jax.tree.map(_spec, args)
            self._pending[key] = self._compiler.submit(lambda: self._compile(fn, statics, specs))
