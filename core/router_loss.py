"""A mixture-of-experts model's router terms (load balance, z-loss) in any method's training loss.

    with RouterTape() as tape:                       # core.train.bind_loss, around every loss
        out = loss_fn(modules, batch, rng)           # each MoE forward records its RouterStats (Decoder.layer_states)
    out = tape.add_to(out, trained_model(modules))   # the trained model's terms, weighted by model.moe

Every method's loss runs its trained model through `Decoder.layer_states`, so pretraining, SFT, DPO, GRPO and
distillation all get the router terms without naming them. The tree's other models (frozen ones) record too, and
are left out: only the records of the tree's trained model count. A loss whose trained model runs several
forward passes (a chosen and a rejected pass) pools their stats, as one pass over all their tokens would.

The terms are means over the micro-batch's real tokens (`RouterStats`); the loss contract sums over items and
divides by the global denominator once (`core.train`), so each term enters `total` times the micro-batch's
denominator: over micro-batches the step then applies their denominator-weighted mean.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # core.models imports this module: no import back at run time
    from core.models.moe import RouterStats

_TAPE: contextvars.ContextVar[list[tuple[Any, RouterStats]] | None] = contextvars.ContextVar("router", default=None)


def record_router(model: Any, stats: RouterStats) -> None:
    """Called by a model's forward pass: its routers' stats, kept while a `RouterTape` is open (else dropped)."""
    tape = _TAPE.get()
    if tape is not None:
        tape.append((model, stats))


class RouterTape:
    """Collects the `RouterStats` of every MoE forward pass traced while it is open."""

    def __init__(self) -> None:
        self.records: list[tuple[Any, RouterStats]] = []
        self._token: contextvars.Token | None = None

    def __enter__(self) -> RouterTape:
        self._token = _TAPE.set(self.records)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _TAPE.reset(self._token)

    def stats_of(self, model: Any) -> RouterStats | None:
        """The pooled stats of `model`'s forward passes (None: it recorded none)."""
        mine = [stats for who, stats in self.records if who is model]
        return sum(mine[1:], mine[0]) if mine else None

    def add_to(self, out: Any, model: Any) -> Any:
        """`out` (a `core.train.LossOutput`) with `model`'s weighted router terms added to its total and its stats
        in `out.router`; unchanged when `model` recorded nothing (a dense model)."""
        stats = self.stats_of(model)
        if stats is None:
            if any(model.cfg.sparse_layers):  # the loss ran a copy of the model, or not the model: no terms to add
                raise RuntimeError("the trained mixture-of-experts model recorded no router stats in its loss")
            return out
        moe = model.cfg.moe
        terms = moe.load_balance_weight * stats.load_balance_loss() + moe.router_z_loss_weight * stats.z_loss()
        return dataclasses.replace(out, total=out.total + terms * out.denominator, router=stats)


def router_metrics(stats: RouterStats) -> dict[str, float]:
    """The logged view of a step's pooled router stats. Expert load is each expert's share of the top-k
    assignments the router chose (dropped ones included) times the number of experts: 1 everywhere is perfect
    balance."""
    import numpy as np

    counts = np.asarray(stats.counts, np.float64)
    load = counts * len(counts) / max(counts.sum(), 1.0)
    out = {
        "moe/load_balance_loss": float(stats.load_balance_loss()),
        "moe/z_loss": float(stats.z_loss()),
        "moe/expert_load_max": float(load.max()),
        "moe/expert_load_min": float(load.min()),
        "moe/expert_load_cv": float(load.std() / max(load.mean(), 1e-12)),
        # the share of top-k assignments past their expert's capacity (0 when dropless)
        "moe/dropped": float(np.asarray(stats.dropped)) / max(float(counts.sum()), 1.0),
    }
    routed = float(np.asarray(stats.routed))
    if routed > 0:  # the batch came with a sampler's routes: the share of tokens whose own top-k set differed
        out["moe/route_mismatch"] = float(np.asarray(stats.differed)) / routed
    return out


def pooled_router_metrics(routers: list[RouterStats | None]) -> dict[str, float]:
    """`router_metrics` of several updates' stats pooled (a step of several updates); {} for a dense model."""
    kept = [r for r in routers if r is not None]
    return router_metrics(sum(kept[1:], kept[0])) if kept else {}
