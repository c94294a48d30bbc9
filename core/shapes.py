"""Input sizes that jitted code has already been compiled for, reused when one fits.

    rows = SizeCache(lambda n: round_rows(n, 2))   # how a new size is rounded
    rows.pick(5)    # -> 6   (new: compiles once)
    rows.pick(3)    # -> 6   (reuses 6: 3 <= 6 <= 2 * round_rows(3))
    rows.pick(2)    # -> 2   (6 > 2 * round_rows(2): too much extra work, a new size)

Every new shape of a jitted function's input compiles it again (seconds on
CPU, tens of seconds for a large model on an accelerator), while padding a
smaller input up to a size already compiled costs only its extra compute. A
`SizeCache` turns a needed size into the smallest size already used that
holds it, if that is at most `slack` times the size it would be bucketed to,
and otherwise into the new bucketed size, which it remembers. A bucket that
keeps being needed is compiled after all: once it has been padded into a
larger size `patience` times (ski rental: the padding paid by then is about
what one compilation costs), it gets its own size, so a long run does not pad
forever and a short run compiles only what it must. Used for the row
counts of a frozen model's log-prob pass (`posttrain.frozen`) and the JAX
sampler's prompt shapes (`rollout.jax_sampler`); a learner's update has its
own plan (`core.shape_plan`).
"""

from __future__ import annotations

from collections.abc import Callable


def bucketed_width(most: int, length: int) -> int:
    """`most` rounded up to a multiple of length / 8 (at least 8), at most `length`: the row and target widths a
    batch is cut to, so that a run compiles its step for a handful of widths at most."""
    step = max(8, length // 8)
    return min(length, max(step, -(-most // step) * step))


class SizeCache:
    def __init__(self, bucket: Callable[[int], int], slack: float = 2.0, patience: int = 8):
        if slack < 1.0:
            raise ValueError(f"slack must be >= 1 (got {slack})")
        self.bucket = bucket
        self.slack = slack
        self.patience = patience
        self.sizes: set[int] = set()
        self.padded: dict[int, int] = {}  # bucket -> times it was padded into a larger size

    def pick(self, needed: int) -> int:
        """The size to use for `needed` (>= needed)."""
        size = self.bucket(needed)
        if size < needed:
            raise ValueError(f"bucket({needed}) = {size} is smaller than the size needed")
        fits = [s for s in self.sizes if needed <= s <= self.slack * size]
        if fits and (size in self.sizes or self.padded.get(size, 0) < self.patience):
            if size not in self.sizes:
                self.padded[size] = self.padded.get(size, 0) + 1
            return min(fits)
        self.sizes.add(size)
        return size
