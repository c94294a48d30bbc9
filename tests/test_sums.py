"""`core.sums`: how a loss's typed record of sums combines over micro-batches and becomes the logged means."""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.sums import combine, identity, maximum, means, summed, to_host


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Inner:
    hits: Any = summed("inner/hits")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Record:
    correct: Any = summed("rewards/accuracies")
    gap: Any = maximum("mismatch/gap_max")
    inner: Any = None
    optional: Any = summed(default=None)


def test_sums_add_maxima_max_nested_records_recurse_and_none_stays_none():
    a = Record(jnp.float32(3.0), jnp.float32(-1.0), Inner(jnp.float32(1.0)))
    b = Record(jnp.float32(2.0), jnp.float32(4.0), Inner(jnp.float32(5.0)))
    c = combine(a, b)
    assert (float(c.correct), float(c.gap), float(c.inner.hits), c.optional) == (5.0, 4.0, 6.0, None)
    # NumPy values (on the host) combine the same way
    host = combine(to_host(a), to_host(b))
    assert (host.correct, host.gap, host.inner.hits) == (5.0, 4.0, 6.0)


def test_the_identity_leaves_a_record_unchanged_inside_jit_and_a_scan():
    records = Record(jnp.array([1.0, 2.0, 3.0]), jnp.array([-5.0, 7.0, 0.5]), Inner(jnp.array([1.0, 0.0, 2.0])))

    @jax.jit
    def total(records):
        first = jax.tree.map(lambda x: x[0], records)

        def step(acc, r):
            return combine(acc, r), None

        out, _ = jax.lax.scan(step, identity(first), records)
        return out

    out = total(records)
    assert (float(out.correct), float(out.gap), float(out.inner.hits)) == (6.0, 7.0, 3.0)
    first = jax.tree.map(lambda x: x[0], records)
    assert float(identity(first).gap) == -np.inf and float(identity(first).correct) == 0.0


def test_means_divide_sums_by_the_denominator_and_report_maxima_as_they_are():
    record = to_host(Record(jnp.float32(6.0), jnp.float32(0.25), Inner(jnp.float32(3.0))))
    assert means(record, 4) == {"rewards/accuracies": 1.5, "mismatch/gap_max": 0.25, "inner/hits": 0.75}
    assert means(record, 0)["rewards/accuracies"] == 6.0  # an empty batch's denominator counts as 1


def test_records_that_cannot_combine_are_refused_by_field():
    @jax.tree_util.register_dataclass
    @dataclass(frozen=True)
    class Undeclared:
        loose: Any = 0.0

    with pytest.raises(TypeError, match="field 'loose' of a sums record must be declared with summed"):
        combine(Undeclared(1.0), Undeclared(2.0))
    with pytest.raises(ValueError, match="sums field 'optional' is None in one record"):
        combine(Record(1.0, 1.0, optional=2.0), Record(1.0, 1.0))
