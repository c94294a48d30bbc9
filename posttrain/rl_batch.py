"""Completions + advantages -> the packed arrays the policy objective trains on (pure NumPy).

Several sequences share a row of `row_len` tokens (first-fit decreasing),
each with its own segment id and positions that restart at 0, so attention
never crosses a sequence and little compute goes to padding. With
`share_prompts` (the default) the completions of one prompt share a single
copy of it: the segment holds the prompt (branch 0) followed by each
completion (branch k), which attends to the prompt and to itself only, with
positions that continue from the prompt's. GRPO samples several completions
per prompt, so this trains on each prompt token once instead of once per
completion (same gradient: the prompt's hidden states do not depend on what
follows). Everything per completion token lives in a `[B, C]` layout, one row
per completion (C = `max_tokens`), and `target_index` says where each of those
tokens is predicted in the packed rows:

    tokens, positions, segment_ids   [R, row_len]   packed sequences (segment 0 = padding)
    branch_ids      [R, row_len]     0 = prompt (or padding), k >= 1 = the segment's k-th completion
    target_index    [B, C] int32     flat index into the group's [R_g * row_len] positions whose
                                     hidden state predicts completion token j (the prompt's last
                                     token for j = 0, else the completion's token j - 1)
    target_ids      [B, C] int32     completion token j itself
    loss_mask       [B, C] f32       1 where completion token j exists and its policy term counts
    kl_mask         [B, C] f32       1 where completion token j exists and its KL term counts
    completion_mask [B, C] f32       1 where completion token j exists (statistics)
    sampler_logp    [B, C] f32       the sampler's log-prob of completion token j
    advantages      [B] f32

Sequences are packed in `groups` contiguous groups (one per optimizer
mini-batch x micro-batch), each into the same number of rows R_g, so that
cutting every array into `groups` equal slices along its first axis gives
self-contained micro-batches; `target_index` is local to its group. See
`posttrain/objective.py` for how the trainer reads this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from rollout.sampler import Completion


def pack_sequences(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices per row, each row's lengths summing to <= row_len."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > row_len:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens > row length {row_len}")
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def round_rows(n: int, multiple: int = 1) -> int:
    """Rows per group, rounded up to two sizes per power of two (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) and to
    `multiple`. Each new row count compiles the update once (~8 s at 100M on 2 CPU cores), so few distinct
    counts matter more than the last padding row (at most a third of the rows are padding)."""
    if n > 2:
        p = 1 << (n - 1).bit_length()
        n = 3 * p // 4 if n <= 3 * p // 4 else p
    return _round_up(n, multiple)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
) -> dict[str, np.ndarray]:
    """Arrays for `posttrain.objective` (layout in the module docstring).

    `keep` (e.g. False for zero-variance groups) and, with `mask_truncated`
    (DAPO), completions that hit the length limit contribute no policy-loss
    tokens. `kl_keep` says whose tokens carry the KL term (e.g. every
    completion but those of failed groups, truncated or not); None: the same
    tokens as the policy term.
    `pack=False` puts one sequence in each row (rows = completions, no shared
    prompts). `share_prompts` lets completions with identical prompt tokens
    in the same packing group share one copy of the prompt. `row_multiple`
    (e.g. the trainer's data-parallel size) divides every group's row count.
    `choose_rows` maps the rows a group needs to the rows it gets (default
    `round_rows`); `posttrain.grpo` passes a `core.shapes.SizeCache` so that a row
    count the update was already compiled for is reused.
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
    layouts = []  # per group: rows, each a list of segments, each a list of completion indices sharing a prompt
    for g in range(groups):
        members = range(g * per_group, (g + 1) * per_group)
        if not pack:
            layouts.append([[[i]] for i in members])
            continue
        segments = prompt_segments(completions, members, row_len) if share_prompts else [[i] for i in members]
        lengths = [len(completions[s[0]].prompt_ids) + sum(len(completions[i].token_ids) for i in s) for s in segments]
        layouts.append([[segments[k] for k in row] for row in pack_sequences(lengths, row_len)])
    most = max(len(rows) for rows in layouts)
    if not pack:
        rows_per_group = _round_up(most, row_multiple)
    else:
        rows_per_group = (choose_rows or (lambda n: round_rows(n, row_multiple)))(most)
        if rows_per_group < most or rows_per_group % row_multiple:
            raise ValueError(
                f"choose_rows({most}) = {rows_per_group}: need at least {most} rows per group, "
                f"a multiple of {row_multiple}"
            )

    r = rows_per_group * groups
    tokens = np.full((r, row_len), pad_id, np.int32)
    positions = np.zeros((r, row_len), np.int32)
    segment_ids = np.zeros((r, row_len), np.int32)
    branch_ids = np.zeros((r, row_len), np.int32)
    target_index = np.zeros((b, max_tokens), np.int32)
    target_ids = np.zeros((b, max_tokens), np.int32)
    loss_mask = np.zeros((b, max_tokens), np.float32)
    kl_mask = np.zeros((b, max_tokens), np.float32)
    completion_mask = np.zeros((b, max_tokens), np.float32)
    sampler_logp = np.zeros((b, max_tokens), np.float32)
    for g, rows in enumerate(layouts):
        for local_row, segments in enumerate(rows):
            row, offset = g * rows_per_group + local_row, 0
            base = local_row * row_len  # target_index is flat within the group's rows
            for segment, members in enumerate(segments, start=1):
                prompt = completions[members[0]].prompt_ids
                p = len(prompt)
                tokens[row, offset : offset + p] = prompt
                positions[row, offset : offset + p] = np.arange(p)
                segment_ids[row, offset : offset + p] = segment
                prompt_last, offset = offset + p - 1, offset + p
                for branch, i in enumerate(members, start=1):
                    c = completions[i]
                    n = len(c.token_ids)
                    tokens[row, offset : offset + n] = c.token_ids
                    positions[row, offset : offset + n] = p + np.arange(n)
                    segment_ids[row, offset : offset + n] = segment
                    branch_ids[row, offset : offset + n] = branch
                    if n:  # token 0 is predicted from the prompt's last position, token j from token j - 1
                        target_index[i, :n] = base + np.r_[prompt_last, offset + np.arange(n - 1)]
                    target_ids[i, :n] = c.token_ids
                    completion_mask[i, :n] = 1.0
                    if c.logprobs is not None:
                        sampler_logp[i, :n] = c.logprobs
                    if bool(keep[i]) and not (mask_truncated and c.finish_reason == "length"):
                        loss_mask[i, :n] = 1.0
                    kl_mask[i, :n] = loss_mask[i, :n] if kl_keep is None else float(bool(kl_keep[i]))
                    offset += n
    return {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segment_ids,
        "branch_ids": branch_ids,
        "target_index": target_index,
        "target_ids": target_ids,
        "loss_mask": loss_mask,
        "kl_mask": kl_mask,
        "completion_mask": completion_mask,
        "sampler_logp": sampler_logp,
        "advantages": np.asarray(advantages, np.float32),
    }


def prompt_segments(completions: Sequence[Completion], members: Sequence[int], row_len: int) -> list[list[int]]:
    """Completion indices grouped by identical prompt tokens (first-seen order), each group cut so that one
    copy of the prompt plus its completions fits in `row_len` tokens."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in members:
        by_prompt.setdefault(tuple(completions[i].prompt_ids), []).append(i)
    segments = []
    for prompt, indices in by_prompt.items():
        segment, used = [], len(prompt)
        for i in indices:
            n = len(completions[i].token_ids)
            if segment and used + n > row_len:
                segments.append(segment)
                segment, used = [], len(prompt)
            segment.append(i)
            used += n
        segments.append(segment)
    return segments


def fill_fraction(batch: dict[str, np.ndarray]) -> float:
    """Share of the packed rows' token slots that hold a real token (1 - padding)."""
    return float((batch["segment_ids"] > 0).mean())
