"""Advantages from rewards, per group of completions of one prompt (pure NumPy).

    adv = group_advantages(rewards, group_size=8, estimator="group_norm")
    adv.values     # [N] per completion
    adv.keep       # [N] False for completions whose group carries no policy signal (flat or failed)
    adv.trainable  # [N] False for completions of failed groups: they add no loss token at all
    adv.zero_variance_groups, adv.failed_groups

rewards are laid out group by group: `rewards[g * G:(g + 1) * G]` are the G
completions of prompt g. A NaN reward is a failed item (a reward function
raised, hung or returned no number; `rewards.runner`).

    group_norm  (r - mean_g) / (std_g + std_eps)   GRPO; std with ddof=1 and eps 1e-4 as in TRL
    drgrpo      r - mean_g                         Dr.GRPO: no std, which biases toward easy/hard prompts
    rloo        r - mean of the other G-1 rewards  = G/(G-1) * (r - mean_g)

A group holding a failed item is dropped whole: the other rewards of the
group would be normalised against a missing one, so no completion of it
trains (advantage 0, `trainable` False: no policy or KL tokens), and it is
counted in `failed_groups`. A group whose rewards are all equal carries no
policy signal (every advantage is 0 under any estimator): its policy term is
masked out (`keep`) and counted; it still carries the KL term when there is
one (`rl.loss.kl_every_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Estimator = Literal["group_norm", "drgrpo", "rloo"]


@dataclass(frozen=True)
class Advantages:
    values: np.ndarray  # [N] float32
    keep: np.ndarray  # [N] bool: the policy term counts
    trainable: np.ndarray  # [N] bool: any loss term may count (False: a failed group)
    zero_variance_groups: int
    failed_groups: int


def group_advantages(
    rewards: np.ndarray, group_size: int, estimator: Estimator = "group_norm", std_eps: float = 1e-4
) -> Advantages:
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {r.shape}")
    if group_size < 2:
        raise ValueError(f"group advantages need group_size >= 2, got {group_size}")
    groups = r.reshape(-1, group_size)  # [P, G]
    failed = np.asarray(~np.isfinite(groups).all(axis=1))  # [P] a group with a failed item
    groups = np.where(failed[:, None], 0.0, groups)  # its values never enter the arithmetic
    mean = groups.mean(axis=1, keepdims=True)
    centered = groups - mean
    if estimator == "group_norm":
        std = groups.std(axis=1, ddof=1, keepdims=True)
        adv = centered / (std + std_eps)
    elif estimator == "drgrpo":
        adv = centered
    elif estimator == "rloo":
        adv = centered * group_size / (group_size - 1)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    flat = (groups == groups[:, :1]).all(axis=1) & ~failed  # [P] every reward equal
    adv[flat | failed] = 0.0
    return Advantages(
        adv.reshape(-1).astype(np.float32),
        np.repeat(~(flat | failed), group_size),
        np.repeat(~failed, group_size),
        int(flat.sum()),
        int(failed.sum()),
    )
