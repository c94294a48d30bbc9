"""Completions + advantages -> the typed batch a policy-gradient update trains on (pure NumPy).

    batch = build_rl_batch(completions, adv.values, adv.keep, row_len=128, max_tokens=16, groups=4)
    batch.packed          # core.batch.PackedBatch: one scored sequence per completion, [B, C = max_tokens]
    batch.loss_mask, batch.kl_mask, batch.advantages, batch.sampler_logp

Sequences are packed into rows by `core.packing` (several per row, first-fit
decreasing, each in its own segment). With `share_prompts` (the default) the
completions of one prompt share a single copy of it: the segment holds the
prompt (branch 0) followed by each completion (branch k), which attends to the
prompt and to itself only, with positions that continue from the prompt's.
GRPO samples several completions per prompt, so this trains on each prompt
token once instead of once per completion (same gradient: the prompt's hidden
states do not depend on what follows). Per completion token `[B, C]`:

    packed.target_*   the completion's tokens, and where each is predicted
    loss_mask         1 where token j's policy term counts (its group has signal; DAPO's mask_truncated)
    kl_mask           1 where token j's KL term counts (`kl_keep`)
    sampler_logp      the sampler's log-prob of token j
    advantages        [B]
    old_logp, ref_logp   pi_old's and the reference's log-probs, filled in by the trainer when needed

Sequences are packed in `groups` contiguous groups (one per optimizer
mini-batch x micro-batch), each into the same number of rows, so that
cutting every array into `groups` equal slices along its first axis gives
self-contained micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from core.batch import PackedBatch
from core.packing import Segment, branch_targets, pack_rows, packed_batch, share_prefixes
from rollout.sampler import Completion


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RLBatch:
    packed: PackedBatch
    loss_mask: Any  # [B, C] float32
    kl_mask: Any  # [B, C] float32
    advantages: Any  # [B] float32
    sampler_logp: Any  # [B, C] float32
    old_logp: Any = None  # [B, C] float32 pi_old; None: the update starts at pi_old (its own pass)
    ref_logp: Any = None  # [B, C] float32 the reference; None when beta = 0

    def replace(self, **changes: Any) -> RLBatch:
        return dataclasses.replace(self, **changes)


def build_rl_batch(
    completions: Sequence[Completion],
    advantages: np.ndarray,
    keep: np.ndarray,
    *,
    row_len: int,
    max_tokens: int,
    groups: int = 1,
    row_multiple: int = 1,
    pack: bool = True,
    share_prompts: bool = True,
    mask_truncated: bool = False,
    kl_keep: np.ndarray | None = None,
    pad_id: int = 0,
    choose_rows: Callable[[int], int] | None = None,
) -> RLBatch:
    """The batch of `completions` (layout in the module docstring).

    `keep` (e.g. False for zero-variance groups) and, with `mask_truncated`
    (DAPO), completions that hit the length limit contribute no policy-loss
    tokens. `kl_keep` says whose tokens carry the KL term (e.g. every
    completion but those of failed groups, truncated or not); None: the same
    tokens as the policy term. `pack=False` puts one sequence in each row (no
    shared prompts). `row_multiple` (the trainer's data-parallel size) divides
    every group's row count; `choose_rows` maps the rows a group needs to the
    rows it gets (default `core.packing.round_rows`; `posttrain.onpolicy.loop` passes a
    `core.shapes.SizeCache` so that a row count already compiled is reused).
    """
    b = len(completions)
    if b % groups:
        raise ValueError(f"{b} completions are not divisible into {groups} groups (mini-batches x micro-batches)")
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.token_ids)
        if p < 1 or n > max_tokens:
            raise ValueError(f"completion {i}: prompt {p} tokens (need >= 1), completion {n} > max_tokens {max_tokens}")
        if p + n > row_len:
            raise ValueError(f"completion {i}: prompt {p} + completion {n} tokens > row length {row_len}")
    per_group = b // groups
    grouped: list[list[list[int]]] = []  # per group: segments, each the completion indices sharing one prompt copy
    for g in range(groups):
        members = list(range(g * per_group, (g + 1) * per_group))
        if pack and share_prompts:
            found = share_prefixes(
                [completions[i].prompt_ids for i in members], [len(completions[i].token_ids) for i in members], row_len
            )
            grouped.append([[members[k] for k in segment] for segment in found])
        else:
            grouped.append([[i] for i in members])
    segments = [
        [Segment(completions[s[0]].prompt_ids, tuple(completions[i].token_ids for i in s)) for s in group]
        for group in grouped
    ]
    rows = pack_rows(segments, row_len, pack=pack, row_multiple=row_multiple, choose_rows=choose_rows, pad_id=pad_id)
    targets: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int32), np.zeros(0, np.int32))] * b
    for g, group in enumerate(grouped):
        for s, members in enumerate(group):
            for branch, i in enumerate(members, start=1):
                targets[i] = branch_targets(rows, g, s, branch)
    packed = packed_batch(rows, targets, max_tokens)
    loss_mask = np.zeros((b, max_tokens), np.float32)
    kl_mask = np.zeros((b, max_tokens), np.float32)
    sampler_logp = np.zeros((b, max_tokens), np.float32)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if c.logprobs is not None:
            sampler_logp[i, :n] = c.logprobs
        if bool(keep[i]) and not (mask_truncated and c.finish_reason == "length"):
            loss_mask[i, :n] = 1.0
        kl_mask[i, :n] = loss_mask[i, :n] if kl_keep is None else float(bool(kl_keep[i]))
    return RLBatch(packed, loss_mask, kl_mask, np.asarray(advantages, np.float32), sampler_logp)
