"""Advantages from rewards (pure NumPy): an estimator by name, per group of one prompt's completions or over the
batch, after the named rewards are summed or each normalised first.

    adv = group_advantages(rewards, group_size=8, estimator="group_norm")
    adv = group_advantages(rewards, 8, "reinforce_pp", tokens=lengths)   # a batch estimator, token-weighted
    adv = normalized_advantages(named_rewards, weights, group_size=8)    # GDPO
    adv.values     # [N] per completion
    adv.keep       # [N] False for completions whose policy term carries no signal (a flat group, a failed one)
    adv.trainable  # [N] False for completions of failed groups: they add no loss token at all
    adv.varied     # [N] True where the completion's group has reward variance (what dynamic sampling keeps)
    adv.zero_variance_groups, adv.failed_groups, adv.normalized  # normalized: GDPO's per-reward metrics

rewards are laid out group by group: `rewards[g * G:(g + 1) * G]` are the G completions of prompt g. A NaN reward
is a failed item (a reward function raised, hung or returned no number; `rewards.runner`).

    group_norm             (r - mean_g) / (std_g + std_eps)    GRPO; std with ddof=1 and eps 1e-4 as in TRL
    drgrpo                 r - mean_g                          Dr.GRPO: no std, which biases toward easy/hard prompts
    rloo                   r - mean of the other G-1 rewards   = G/(G-1) * (r - mean_g)
    reinforce_pp           whiten_batch(r)                     REINFORCE++ (OpenRLHF, verl `reinforce_plus_plus`):
                                                               the batch's mean and std, no group baseline
    reinforce_pp_baseline  whiten_batch(r - mean_g)            REINFORCE++ with a group baseline (verl's
                                                               `reinforce_plus_plus_baseline`)

whiten_batch(x) = (x - mean) / (std + std_eps) over the completions of the groups that did not fail, each
weighted by its trained tokens (`tokens`; verl and OpenRLHF whiten over the batch's tokens), std with Bessel's
correction over those tokens. A group of equal rewards carries no signal under a group baseline (its advantages
are 0, its policy term masked out, `keep`) but does under REINFORCE++ without one (the batch's baseline differs
from its reward).

`aggregation` (GDPO, `rl.advantage.aggregation`): `sum_then_normalize` sums the named rewards (weighted) and
hands the total to the estimator; `normalize_then_sum` normalises each named reward within its group first, (r_k -
mean_g) / (std_g + 1e-4), sums them weighted, then whitens the sum over the batch's completions (unweighted; TRL's
`normalize_then_sum`, from the GDPO paper), so that a reward with a wide range cannot drown one with a narrow range.
The estimator is then not used (the config refuses another than `group_norm`).

A group holding a failed item is dropped whole: the other rewards of the group would be normalised against a
missing one, so no completion of it trains (advantage 0, `trainable` False: no policy or KL tokens), it enters no
batch statistic, and it is counted in `failed_groups`. A flat group still carries the KL term when there is one
(`rl.loss.kl_every_token`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]
GDPO_EPS = 1e-4  # TRL's, in each reward's group normalisation


@dataclass(frozen=True)
class Advantages:
    values: np.ndarray  # [N] float32
    keep: np.ndarray  # [N] bool: the policy term counts
    trainable: np.ndarray  # [N] bool: any loss term may count (False: a failed group)
    zero_variance_groups: int
    failed_groups: int
    varied: np.ndarray | None = None  # [N] bool: the group's rewards differ (None: as keep)
    normalized: dict[str, float] = field(default_factory=dict)  # GDPO: each reward's statistics after normalising

    @property
    def signal(self) -> np.ndarray:
        """[N] True where the group has reward variance and did not fail (what DAPO's dynamic sampling keeps)."""
        return self.keep if self.varied is None else self.varied


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: str = "group_norm"
    std_eps: float = 1e-4
    aggregation: Aggregation = "sum_then_normalize"


# An estimator: (rewards [P, G] (a failed group's zeroed), usable [P] (not failed), tokens [P, G], std_eps) -> [P, G]
EstimatorFn = Callable[[np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]


@dataclass(frozen=True)
class Estimator:
    fn: EstimatorFn
    flat_signal: bool  # whether a group of equal rewards still has a policy signal (a batch-level baseline)


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, flat_signal: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    def add(fn: EstimatorFn) -> EstimatorFn:
        ESTIMATORS[name] = Estimator(fn, flat_signal)
        return fn

    return add


def whiten(x: np.ndarray, usable: np.ndarray, tokens: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / (std + eps) over the usable groups' completions, each weighted by its tokens (module docstring)."""
    w = np.where(usable[:, None], np.asarray(tokens, np.float64), 0.0)
    total = w.sum()
    if total <= 1:
        return np.zeros_like(x)
    mean = (w * x).sum() / total
    var = (w * (x - mean) ** 2).sum() / (total - 1)
    return (x - mean) / (np.sqrt(var) + eps)


@register_estimator("group_norm")
def _group_norm(r: np.ndarray, usable: np.ndarray, tokens: np.ndarray, eps: float) -> np.ndarray:
    return (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + eps)


@register_estimator("drgrpo")
def _drgrpo(r: np.ndarray, usable: np.ndarray, tokens: np.ndarray, eps: float) -> np.ndarray:
    return r - r.mean(1, keepdims=True)


@register_estimator("rloo")
def _rloo(r: np.ndarray, usable: np.ndarray, tokens: np.ndarray, eps: float) -> np.ndarray:
    g = r.shape[1]
    return (r - r.mean(1, keepdims=True)) * g / (g - 1)


@register_estimator("reinforce_pp", flat_signal=True)
def _reinforce_pp(r: np.ndarray, usable: np.ndarray, tokens: np.ndarray, eps: float) -> np.ndarray:
    return whiten(r, usable, tokens, eps)


@register_estimator("reinforce_pp_baseline")
def _reinforce_pp_baseline(r: np.ndarray, usable: np.ndarray, tokens: np.ndarray, eps: float) -> np.ndarray:
    return whiten(r - r.mean(1, keepdims=True), usable, tokens, eps)


def group_advantages(
    rewards: np.ndarray,
    group_size: int,
    estimator: str = "group_norm",
    std_eps: float = 1e-4,
    tokens: np.ndarray | None = None,
) -> Advantages:
    """Advantages of the summed rewards by `estimator` (module docstring); `tokens` [N]: each completion's trained
    tokens, the weights of the batch estimators (None: 1 each)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
    groups, failed = _groups(rewards, group_size)
    weights = np.ones_like(groups) if tokens is None else np.asarray(tokens, np.float64).reshape(groups.shape)
    spec = ESTIMATORS[estimator]
    adv = spec.fn(groups, ~failed, weights, std_eps)
    flat = (groups == groups[:, :1]).all(axis=1) & ~failed  # [P] every reward equal
    silent = failed if spec.flat_signal else flat | failed  # groups whose policy term carries nothing
    return _advantages(adv, silent, flat, failed)


def normalized_advantages(
    values: Mapping[str, np.ndarray], weights: Mapping[str, float], group_size: int, std_eps: float = 1e-4
) -> Advantages:
    """GDPO (`normalize_then_sum`): each named reward (`values`: name -> [N] unweighted, NaN where failed)
    normalised in its group, summed with `weights` (1 where absent), the sum whitened over the batch."""
    names = list(values)
    stacked = np.stack([np.asarray(values[k], np.float64) for k in names], axis=-1)  # [N, K]
    w = np.array([weights.get(k, 1.0) for k in names], np.float64)
    _, failed = _groups(stacked.sum(-1), group_size)  # a failed item in any reward fails its group
    per = np.where(failed[:, None, None], 0.0, np.nan_to_num(stacked).reshape(failed.size, group_size, len(names)))
    z = (per - per.mean(1, keepdims=True)) / (per.std(1, ddof=1, keepdims=True) + GDPO_EPS)  # [P, G, K]
    summed = (z * w).sum(-1)
    adv = whiten(summed, ~failed, np.ones_like(summed), std_eps)  # per completion, as TRL
    flat = (per == per[:, :1]).all(axis=(1, 2)) & ~failed  # every reward equal across the group
    normalized = {}
    for k, name in enumerate(names):
        kept = z[~failed][..., k]
        normalized[f"reward/{name}/normalized_mean"] = float(kept.mean()) if kept.size else 0.0
        normalized[f"reward/{name}/normalized_std"] = float(kept.std()) if kept.size else 0.0
    out = _advantages(adv, flat | failed, flat, failed)
    return dataclasses.replace(out, normalized=normalized)


def _groups(rewards: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[P, G] rewards (a failed group's zeroed, so its values never enter the arithmetic) and [P] failed."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {r.shape}")
    if group_size < 2:
        raise ValueError(f"group advantages need group_size >= 2, got {group_size}")
    groups = r.reshape(-1, group_size)
    failed = np.asarray(~np.isfinite(groups).all(axis=1))
    return np.where(failed[:, None], 0.0, groups), failed


def _advantages(adv: np.ndarray, silent: np.ndarray, flat: np.ndarray, failed: np.ndarray) -> Advantages:
    g = adv.shape[1]
    adv = np.where(silent[:, None], 0.0, adv)
    return Advantages(
        adv.reshape(-1).astype(np.float32),
        np.repeat(~silent, g),
        np.repeat(~failed, g),
        int(flat.sum()),
        int(failed.sum()),
        np.repeat(~(flat | failed), g),
    )
