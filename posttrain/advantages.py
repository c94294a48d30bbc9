"""Advantages from rewards, per group of completions of one prompt (pure NumPy).

    adv = group_advantages(rewards, group_size=8, estimator="group_norm")
    adv.values   # [N] per completion
    adv.keep     # [N] False for completions of groups whose rewards are all equal
    adv.zero_variance_groups

rewards are laid out group by group: `rewards[g * G:(g + 1) * G]` are the G
completions of prompt g.

    group_norm  (r - mean_g) / max(std_g, std_floor)   GRPO; std with ddof=1 as in TRL and verl
    drgrpo      r - mean_g                              Dr.GRPO: no std, which biases toward easy/hard prompts
    rloo        r - mean of the other G-1 rewards       = G/(G-1) * (r - mean_g)

A group whose rewards are all equal carries no signal (every advantage is 0
under any estimator); it is masked out (`keep`) and counted, so it adds
neither tokens nor sequences to the loss normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Estimator = Literal["group_norm", "drgrpo", "rloo"]


@dataclass(frozen=True)
class Advantages:
    values: np.ndarray  # [N] float32
    keep: np.ndarray  # [N] bool
    zero_variance_groups: int


def group_advantages(rewards: np.ndarray, group_size: int, estimator: Estimator = "group_norm",
                     std_floor: float = 1e-6) -> Advantages:
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {r.shape}")
    if group_size < 2:
        raise ValueError(f"group advantages need group_size >= 2, got {group_size}")
    groups = r.reshape(-1, group_size)  # [P, G]
    mean = groups.mean(axis=1, keepdims=True)
    centered = groups - mean
    if estimator == "group_norm":
        std = groups.std(axis=1, ddof=1, keepdims=True)
        adv = centered / np.maximum(std, std_floor)
    elif estimator == "drgrpo":
        adv = centered
    elif estimator == "rloo":
        adv = centered * group_size / (group_size - 1)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    flat = (groups == groups[:, :1]).all(axis=1)  # [P] every reward equal
    adv[flat] = 0.0
    keep = np.repeat(~flat, group_size)
    return Advantages(adv.reshape(-1).astype(np.float32), keep, int(flat.sum()))
