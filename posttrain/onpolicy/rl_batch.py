"""The policy-gradient batch every sampling method trains on: completions packed into rows, per-token masks.

    batch = build_rl_batch(completions, advantages, keep, row_len=128, max_tokens=16, groups=4)

The batch (`RLBatch`, pure NumPy): completions packed into rows by `core.packing` (several per row, first-fit
decreasing, each in its own segment). With `share_prompts` (the default) the completions of one prompt share a
single copy of it: the segment holds the prompt (branch 0) followed by each completion (branch k), which attends
to the prompt and to itself only, with positions that continue from the prompt's. GRPO samples several
completions per prompt, so this trains on each prompt token once instead of once per completion (same gradient:
the prompt's hidden states do not depend on what follows). Per completion token `[B, C]`:

    packed.target_*   the completion's tokens, and where each is predicted
    loss_mask         1 where token j's policy term counts: the model sampled it (not an environment), its group
                      has signal (DAPO's mask_truncated)
    kl_mask           1 where token j's KL term counts (`kl_keep`)
    sampler_logp      the sampler's log-prob of token j
    advantages        token j's advantage: a completion's one value broadcast over its tokens (GRPO), or a value
                      per token (on-policy distillation)
    old_logp, ref_logp   pi_old's and the reference's log-probs, filled in by the learner when needed

Sequences are packed in `groups` contiguous groups (one per optimizer mini-batch x micro-batch), each into the
same number of rows, so that cutting every array into `groups` equal slices along its first axis gives
self-contained micro-batches.

An episode whose agent rewrote its history through the endpoint is several trajectories (`Episode.earlier`, then its
last): `with_segments` puts its earlier ones before it in its packing group, each a sequence of its own with the
episode's advantage, and pads every group to one count of sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from core.batch import PackedBatch
from core.packing import PackedRows, Segment, branch_targets, pack_rows, packed_batch, share_prefixes
from rollout.sampler import Completion


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RLBatch:
    packed: PackedBatch
    loss_mask: Any  # [B, C] float32
    kl_mask: Any  # [B, C] float32
    advantages: Any  # [B, C] float32
    sampler_logp: Any  # [B, C] float32
    old_logp: Any = None  # [B, C] float32 pi_old; None: the update starts at pi_old (its own pass)
    ref_logp: Any = None  # [B, C] float32 the reference; None when beta = 0
    entropy_coef: Any = None  # [B, C] float32 the entropy bonus's coefficient, every slot alike (adaptive control)

    def replace(self, **changes: Any) -> RLBatch:
        return dataclasses.replace(self, **changes)


def build_rl_batch(
    completions: Sequence[Completion],
    advantages: np.ndarray | Sequence[np.ndarray],
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
    replay: bool = False,
) -> RLBatch:
    """The batch of `completions` (layout in the module docstring).

    `advantages` is one value per completion (`[N]`, broadcast over its tokens) or one array per completion with a
    value per token. `keep` (e.g. False for zero-variance groups) and, with `mask_truncated`
    (DAPO), completions that hit the length limit contribute no policy-loss
    tokens. `kl_keep` says whose tokens carry the KL term (e.g. every
    completion but those of failed groups, truncated or not); None: the same
    tokens as the policy term. `pack=False` puts one sequence in each row (no
    shared prompts). `row_multiple` (the trainer's data-parallel size) divides
    every group's row count; `choose_rows` maps the rows a group needs to the
    rows it gets (default `core.packing.round_rows`; `posttrain.grpo` passes a
    `core.shapes.SizeCache` so that a row count already compiled is reused).

    When every completion carries its routes (`Completion.routes`: a mixture-of-experts sampler's), the batch
    carries them in the row layout (`PackedBatch.routes`), used in the forward pass with `replay` (routing
    replay), else only compared with the trainer's own routing.
    """
    b = len(completions)
    per_group = group_size(b, groups)
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.token_ids)
        if p < 1 or n > max_tokens:
            raise ValueError(f"completion {i}: prompt {p} tokens (need >= 1), completion {n} > max_tokens {max_tokens}")
        if p + n > row_len:
            raise ValueError(f"completion {i}: prompt {p} + completion {n} tokens > row length {row_len}")
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
    if all(c.routes is not None for c in completions):
        packed = dataclasses.replace(packed, routes=row_routes(rows, grouped, completions), replay=replay)
    elif replay:
        missing = sum(c.routes is None for c in completions)
        raise ValueError(
            f"rl.router_replay=replay, but {missing} of {b} completions came without routes (Completion.routes): a "
            "dense policy has none to replay"
        )
    # An environment's tokens in a multi-turn trajectory (`Completion.sampled`) are context: not targets at all, so
    # the head never scores them and no loss, KL, entropy or mismatch figure reads them.
    mask = np.asarray(packed.target_mask)
    for i, c in enumerate(completions):
        if c.sampled is not None:
            if len(c.sampled) != len(c.token_ids):
                raise ValueError(f"completion {i}: {len(c.sampled)} sampled flags for its {len(c.token_ids)} tokens")
            mask[i, : len(c.sampled)] *= np.asarray(c.sampled, mask.dtype)
    loss_mask = np.zeros((b, max_tokens), np.float32)
    kl_mask = np.zeros((b, max_tokens), np.float32)
    sampler_logp = np.zeros((b, max_tokens), np.float32)
    token_adv = np.zeros((b, max_tokens), np.float32)
    per_sequence = isinstance(advantages, np.ndarray) and advantages.ndim == 1
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        if per_sequence:
            token_adv[i, :n] = advantages[i]
        else:
            values = np.asarray(advantages[i], np.float32)
            if values.shape != (n,):
                raise ValueError(f"completion {i}: {values.shape} advantages for its {n} tokens")
            token_adv[i, :n] = values
        if c.logprobs is not None:
            sampler_logp[i, :n] = c.logprobs
        own = mask[i, :n]  # the model's own tokens (an environment's are context)
        if bool(keep[i]) and not (mask_truncated and c.finish_reason == "length"):
            loss_mask[i, :n] = own
        kl_mask[i, :n] = loss_mask[i, :n] if kl_keep is None else float(bool(kl_keep[i])) * own
    return RLBatch(packed, loss_mask, kl_mask, token_adv, sampler_logp)


def group_size(b: int, groups: int) -> int:
    """The completions of each packing group, `b` cut into `groups` equal ones (refused where it cannot be)."""
    if b % groups:
        raise ValueError(f"{b} completions are not divisible into {groups} groups (mini-batches x micro-batches)")
    return b // groups


def placeholder(c: Completion, pad_id: int = 0) -> Completion:
    """An episode that trains nothing and holds no token (its reset failed, its prompt did not fit, its agent never
    called the model) as one pad token: it keeps its place in the batch's layout."""
    return dataclasses.replace(c, prompt_ids=[pad_id], token_ids=[], logprobs=[], sampled=None)


def with_segments(
    completions: Sequence[Completion],
    earlier: Sequence[Sequence[Completion]],
    advantages: np.ndarray,
    flags: Sequence[np.ndarray],
    groups: int,
    pad_id: int = 0,
) -> tuple[list[Completion], np.ndarray, list[np.ndarray]]:
    """Each trajectory's `earlier` segments (of the same episode, in the order they started) just before it, in its
    packing group, each with its advantage (`advantages`: one value per trajectory) and its `flags` (per trajectory:
    keep, kl_keep), so that a segment trains as the episode's last trajectory does. Every group is padded with empty
    sequences (a pad token, no target, flags False) to one count: its trajectories times the smallest power of two
    that holds the group with the most segments, so that the trainer compiles for few batch sizes (a sequence's
    count is part of the step's shape; an empty one costs a position, or a row when sequences are not packed). With
    no earlier segment, the same lists."""
    b = len(completions)
    if len(earlier) != b:
        raise ValueError(f"earlier segments for {len(earlier)} of {b} trajectories")
    per_group = group_size(b, groups)
    order = [[(i, k) for i in range(g * per_group, (g + 1) * per_group) for k in range(len(earlier[i]) + 1)]
             for g in range(groups)]  # fmt: skip
    most = max(len(group) for group in order)
    size = per_group * (1 << (-(-most // per_group) - 1).bit_length())  # per_group x a power of two >= most
    empty = Completion([pad_id], [], [], "stop", "")
    out: list[Completion] = []
    values: list[float] = []
    picked: list[list[bool]] = [[] for _ in flags]
    for group in order:
        for i, k in group + [(-1, 0)] * (size - len(group)):
            out.append(empty if i < 0 else (earlier[i][k] if k < len(earlier[i]) else completions[i]))
            values.append(0.0 if i < 0 else float(advantages[i]))
            for f, flag in zip(picked, flags, strict=True):
                f.append(i >= 0 and bool(flag[i]))
    return out, np.asarray(values, np.float32), [np.asarray(f, bool) for f in picked]


def row_routes(rows: PackedRows, grouped: list[list[list[int]]], completions: Sequence[Completion]) -> np.ndarray:
    """The completions' routes (`Completion.routes`, [tokens, sparse layers, k] each) at their tokens' places in the
    packed rows: [R, L, sparse layers, k] int32, -1 on padding. A segment's shared prompt takes its first member's
    prompt routes (a prompt's prefill routes the same whichever sample it starts). Routes that do not cover their
    completion's tokens are refused, naming the completion."""
    routes = [c.routes for c in completions]
    shape = routes[0].shape[1:]  # type: ignore[union-attr]
    for i, (c, r) in enumerate(zip(completions, routes, strict=True)):
        want = (len(c.prompt_ids) + len(c.token_ids), *shape)
        if r is None or r.shape != want:
            raise ValueError(
                f"completion {i}: routes of shape {None if r is None else r.shape} for its prompt and completion "
                f"tokens (expected {want})"
            )
    out = np.full((*rows.tokens.shape, *shape), -1, np.int32)
    for g, group in enumerate(grouped):
        for s, members in enumerate(group):
            place = rows.placements[g][s]
            row = g * rows.rows_per_group + place.row
            p = len(completions[members[0]].prompt_ids)
            out[row, place.start : place.start + p] = routes[members[0]][:p]  # type: ignore[index]
            for start, i in zip(place.branch_starts, members, strict=True):
                n = len(completions[i].token_ids)
                out[row, start : start + n] = routes[i][p : p + n]  # type: ignore[index]
    return out
