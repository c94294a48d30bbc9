"""Optimizers, learning-rate schedules, clipping and freezing, built with optax from `OptimConfig`.

- AdamW with weight decay masked off norms and biases; SGD; Muon (optax.contrib)
  on projection matrices with Adam for embeddings, norms and biases.
- Schedules: constant, cosine, WSD (warmup-stable-decay), each with linear warm-up.
- A module tree whose trainable parts each need their own optimizer (a learning rate, a clip, a start of their
  own) combines one per part (`by_part`), one of them held for its first updates
  (`held_for`).
- `trainable_regex` is not the optimizer's: it narrows what trains (`trainable_paths`, a filter the learner
  splits the module tree with), so the rest is frozen state with no gradient, no moments and no checkpoint.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from core.config import OptimConfig


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step (0-based), peaking at `cfg.learning_rate`."""
    peak = cfg.learning_rate
    final = peak * cfg.learning_rate_final_fraction
    warmup = round(cfg.warmup_steps_fraction * total_steps)
    ramp = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
    if cfg.schedule == "constant":
        rest = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        rest = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1), alpha=cfg.learning_rate_final_fraction)
    else:  # wsd: stable at the peak, then a linear decay over the last wsd_decay_steps_fraction
        decay = round(cfg.wsd_decay_steps_fraction * total_steps)
        stable = max(total_steps - warmup - decay, 0)
        rest = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, final, max(decay, 1))], [stable]
        )
    return optax.join_schedules([ramp, rest], [warmup]) if warmup else rest


def param_paths(params: nnx.State) -> Any:
    """A tree like `params` whose leaves are the dotted parameter paths."""
    return nnx.from_flat_state([(path, ".".join(map(str, path))) for path, _ in nnx.to_flat_state(params)])


def _map_paths(params: nnx.State, fn) -> Any:
    return jax.tree.map(fn, param_paths(params))


def _is_decayed(path: str) -> bool:
    return not (path.endswith(".scale") or path.endswith(".bias"))


def _muon_dims(params: nnx.State) -> Any:
    """Muon's (reduction, output) axes for projection kernels from their logical axes; None -> Adam."""
    flat = dict(nnx.to_flat_state(params))

    def dims(path_tuple):
        var = flat[path_tuple]
        name = ".".join(map(str, path_tuple))
        # Muon orthogonalises hidden projections; the output head (and anything not a projection kernel: LoRA's
        # factors, norms, a method's own parameters) takes Adam.
        if not name.endswith(".kernel") or "lm_head" in path_tuple:
            return None
        axes = list(var.get_metadata("logical_axes"))
        embed = axes.index("embed")
        others = tuple(i for i, a in enumerate(axes) if a not in ("embed", "layers"))
        first = 1 if axes[0] == "layers" else 0  # the stacked-layers axis is a batch axis for Muon
        if embed == first:  # [D, ...] kernels read the model dimension: q/k/v, gate/up
            return MuonDimensionNumbers(reduction_axis=(embed,), output_axis=others)
        return MuonDimensionNumbers(reduction_axis=others, output_axis=(embed,))  # o_proj, down_proj

    return nnx.from_flat_state([(p, dims(p)) for p in flat])


def make_optimizer(cfg: OptimConfig, total_steps: int, params: nnx.State) -> optax.GradientTransformation:
    """The full transformation over the trainable state `params` (a method's module tree cut by its trainable
    filter: a model's parameters, its LoRA adapters, a model and modules trained with it, narrowed by
    `trainable_regex`): clip -> optimizer (with schedule)."""
    schedule = make_schedule(cfg, total_steps)
    decay_mask = _map_paths(params, _is_decayed)
    if cfg.name == "adamw":
        opt = optax.adamw(schedule, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "sgd":
        opt = optax.sgd(schedule)
    else:
        opt = optax.contrib.muon(
            schedule,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=decay_mask,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            eps=cfg.eps,
            muon_weight_dimension_numbers=_muon_dims(params),
        )
    chain = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm else []
    return optax.chain(*chain, opt)


def trainable_paths(trainable: Any, regex: str | None) -> Any:
    """The filter of what trains: `trainable` (a method's, e.g. every parameter or the LoRA adapters), narrowed by
    `optim.trainable_regex` to the parameters whose dotted path in the module tree matches it (re.search)."""
    if regex is None:
        return trainable
    pattern = re.compile(regex)
    return nnx.All(trainable, lambda path, _: bool(pattern.search(".".join(map(str, path)))))


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


class HeldState(NamedTuple):
    # updates applied so far, held ones included (a skipped non-finite update is not one: it lengthens the hold)
    updates: jax.Array
    inner: Any  # the held transformation's own state: untouched while held


def held_for(tx: optax.GradientTransformation, n: int) -> optax.GradientTransformation:
    """`tx` from its (n+1)-th update on; before, zero updates and `tx`'s state as it was initialised, so its
    moments, its bias correction and its schedule all start at its first real update (a part that waits while
    another warms up)."""

    def init(params):
        return HeldState(jnp.zeros((), jnp.int32), tx.init(params))

    def update(updates, state, params=None):
        new, inner = tx.update(updates, state.inner, params)
        on = state.updates >= n
        held = jax.tree.map(lambda u: jnp.where(on, u, jnp.zeros_like(u)), new)
        kept = jax.tree.map(lambda a, b: jnp.where(on, a, b), inner, state.inner)
        return held, HeldState(state.updates + 1, kept)

    return optax.GradientTransformation(init, update)


def part_of(tree: Any, key: str) -> nnx.State:
    """The part of a trainable state under its top-level `key`, still under that key (what `by_part` gives each
    part's transformation, and what that transformation is built over)."""
    raw = tree.raw_mapping if isinstance(tree, nnx.State) else tree
    return nnx.State({key: raw[key]})


def by_part(parts: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One transformation per top-level key of the trainable state (a module tree's parts), each over its part
    alone with a state of its own: its own clip (its part's gradient norm), moments and schedule. Each is given
    its part still under its key (`part_of`), so its masks and its state's paths are the tree's."""

    def init(params):
        if set(params.keys()) != set(parts):
            raise ValueError(f"the trainable state's parts {sorted(params.keys())} are not {sorted(parts)}")
        return {key: tx.init(part_of(params, key)) for key, tx in parts.items()}

    def update(updates, state, params=None):
        moved, states = {}, {}
        for key, tx in parts.items():
            given = None if params is None else part_of(params, key)
            out, states[key] = tx.update(part_of(updates, key), state[key], given)
            moved[key] = iter(jax.tree.leaves(out))
        # back into `updates`' own structure, leaf by leaf (each part's leaves in the order its subtree holds them)
        return jax.tree_util.tree_map_with_path(lambda path, _: next(moved[path[0].key]), updates), states

    return optax.GradientTransformation(init, update)
