"""Adaptive entropy control: the entropy bonus's coefficient moved toward a target entropy, step by step
(Skywork-OR1's; TRL's `use_adaptive_entropy`).

    control = EntropyControl(coef=0.0, target=0.2, lo=0.0, hi=1.0, delta=0.005)
    coef = control.applied()        # the coefficient this step's loss uses
    control.update(entropy)         # after the step: its mean entropy over the trained tokens

After each step, a mean entropy at or below `target` raises the coefficient by `delta` (to `hi`), one above it lowers
it (to `lo`); the coefficient is applied only while the last step's entropy was at or below the target (0 before the
first step), as TRL does. TRL updates it after every optimizer update; here after every step (the same with one
update a step). Its state (`state`, `from_state`) is checkpointed with the run, so a resumed run applies what an
uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class EntropyControl:
    coef: float  # the coefficient now (rl.loss.entropy_coef at the start)
    target: float
    lo: float
    hi: float
    delta: float
    last: float = math.inf  # the latest step's mean entropy (none yet: above any target)

    def applied(self) -> float:
        """The coefficient the next step's loss uses: the current one while entropy is at or below the target."""
        return self.coef if self.last <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After a step whose trained tokens' mean entropy was `entropy`."""
        if not math.isfinite(entropy):
            return  # a step without an update (or a failed one) measured nothing
        step = self.delta if entropy <= self.target else -self.delta
        self.coef = min(max(self.coef + step, self.lo), self.hi)
        self.last = entropy

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> EntropyControl:
        return cls(**state)
