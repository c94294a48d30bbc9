"""A mixture-of-experts model's router terms (load balance, z-loss) in any method's training loss.

    out, sown = capture_router(loss_fn)(modules, batch, rng)   # core.train.bind_loss, around every loss
    stats = sown_at(sown, trained_model_path(modules))         # the trained model's pooled RouterStats (or None)
    out = add_router_terms(out, trained_model(modules), stats) # weighted by model.moe

The stats travel through Flax's own channel: each MoE forward pass sows its `RouterStats` into the model that ran
it (`Decoder.layer_states` -> `record_router`, a `Module.sow` of a `RouterSown` variable) and `nnx.capture`
collects what every module of the tree sowed, keyed by its path in the tree. Only the trained model's path counts:
a frozen MoE model in the tree sows under its own path and adds nothing. Outside a capture nothing is
kept (Flax would otherwise store the value on the module, and a model called for generation would change its
state). Every method's loss runs its trained model through `Decoder.layer_states`, so pretraining, SFT, DPO, GRPO
and distillation all get the router terms without naming them. A loss whose trained model runs several forward
passes (a chosen and a rejected pass) pools their stats, as one pass over all their tokens would.

The terms are means over the micro-batch's real tokens (`RouterStats`); the loss contract sums over items and
divides by the global denominator once (`core.train`), so each term enters `total` times the micro-batch's
denominator: over micro-batches the step then applies their denominator-weighted mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flax import nnx

if TYPE_CHECKING:  # core.models imports this module: no import back at run time
    from core.models.moe import RouterStats

SOWN = "router_stats"  # the name a model's stats are sown under


class RouterSown(nnx.Intermediate):
    """The `RouterStats` a forward pass sowed (what `capture_router` collects)."""


def _pool(previous: RouterStats | None, stats: RouterStats) -> RouterStats:
    return stats if previous is None else previous + stats


def record_router(model: nnx.Module, stats: RouterStats) -> None:
    """Called by a model's forward pass: its routers' stats, sown while a capture is open (`capture_router`),
    pooled with the model's other passes; outside one, dropped."""
    if hasattr(model, "__captures__"):  # what nnx.capture sets on every module it collects from
        model.sow(RouterSown, SOWN, stats, reduce_fn=_pool, init_fn=lambda: None)


def capture_router(fn: Callable[..., Any]) -> Callable[..., tuple[Any, nnx.State]]:
    """`fn(module, ...)` -> `(fn's output, what the module tree sowed)`: read one model's stats with `sown_at`."""
    return nnx.capture(fn, RouterSown)


def sown_at(sown: nnx.State, path: Sequence[str] = ()) -> RouterStats | None:
    """The pooled stats the model at `path` in the captured tree sowed (None: it sowed none, a dense model)."""
    node: Any = sown
    for key in path:
        if key not in node:
            return None
        node = node[key]
    return node[SOWN].get_value() if SOWN in node else None


def add_router_terms(out: Any, model: Any, stats: RouterStats | None) -> Any:
    """`out` (a `core.train.LossOutput`) with `model`'s weighted router terms added to its total and its stats
    in `out.router`; unchanged when `model` sowed nothing (a dense model)."""
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
