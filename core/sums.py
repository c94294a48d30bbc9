"""Typed records of what a loss sums besides the loss itself, each field saying how it combines.

    @jax.tree_util.register_dataclass
    @dataclass(frozen=True)
    class PairSums:
        accuracies: Any = summed("rewards/accuracies")   # a sum over pairs; reported per pair
        gap_max: Any = maximum("mismatch/gap_max")        # a maximum; reported as it is

    total = combine(a, b)                    # micro-batches, batches, updates: a sum field adds, a max field maxes
    means(total, denominator)                # {"rewards/accuracies": sum / denominator, "mismatch/gap_max": max}

A loss (`core.train.LossOutput`) returns its summed loss, the denominator it is normalised by and one of these
records. The train step combines the records of its micro-batches field by field and returns the combined
record as it is (sums, not means): a method that needs the sums (GRPO's statistics over several updates) reads
them directly, and `means` turns them into the per-denominator values the logs show. Within a jitted step the
arrays are global, so a process group's micro-batches combine the same way. A field may be None (a term the
loss does not have in this configuration): it stays None and is not reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

R = TypeVar("R")
Reduce = Literal["sum", "max"]


def summed(name: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A field summed over micro-batches and reported divided by the loss's denominator (`name`: the metric's
    name in the logs; default the field's)."""
    return field(default=default, metadata={"reduce": "sum", "name": name})


def maximum(name: str | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A field combined by max over micro-batches and reported as it is."""
    return field(default=default, metadata={"reduce": "max", "name": name})


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class NoSums:
    """The record of a loss that sums nothing besides itself (the next-token loss)."""


def _is_record(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _reduce(f: dataclasses.Field) -> Reduce:
    reduce = f.metadata.get("reduce")
    if reduce not in ("sum", "max"):
        raise TypeError(f"field {f.name!r} of a sums record must be declared with summed() or maximum()")
    return reduce


def _map(fn: Callable[[Reduce, Any, Any], Any], a: R, b: R) -> R:
    """A record like `a` whose leaves are fn(reduce, a's value, b's value), nested records recursed into."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None:
            if (x is None) != (y is None):
                raise ValueError(f"sums field {f.name!r} is None in one record and not in the other")
            changes[f.name] = None
        elif _is_record(x):
            changes[f.name] = _map(fn, x, y)
        else:
            changes[f.name] = fn(_reduce(f), x, y)
    return dataclasses.replace(a, **changes)  # type: ignore[type-var]


def combine(a: R, b: R) -> R:
    """Two records of the same type combined field by field: sums add, maxima max (jax or NumPy values)."""

    def one(reduce: Reduce, x, y):
        if reduce == "max":
            return jnp.maximum(x, y) if isinstance(x, jax.Array) or isinstance(y, jax.Array) else np.maximum(x, y)
        return x + y

    return _map(one, a, b)


def identity(record: R) -> R:
    """The record that `combine` leaves unchanged: zeros for sums, -inf for maxima (float32)."""

    def one(reduce: Reduce, x, _):
        return jnp.full(jnp.shape(x), -jnp.inf if reduce == "max" else 0.0, jnp.float32)

    return _map(one, record, record)


def means(record: Any, denominator: float) -> dict[str, float]:
    """{metric name: value} of a (host) record: a sum divided by `denominator` (at least 1), a maximum as it is;
    None fields left out, nested records flattened."""
    n = max(float(denominator), 1.0)
    out: dict[str, float] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None:
            continue
        if _is_record(value):
            out.update(means(value, n))
            continue
        name = f.metadata.get("name") or f.name
        out[name] = float(value) if _reduce(f) == "max" else float(value) / n
    return out


def to_host(record: R) -> R:
    """The record with every scalar a Python float and every other array a NumPy array (after `jax.device_get`;
    a mixture-of-experts model's per-expert counts are arrays)."""

    def host(x: Any) -> Any:
        x = np.asarray(x)
        return float(x) if x.ndim == 0 else x

    return jax.tree.map(host, record)
