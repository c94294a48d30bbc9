"""Shaping rewards: a regex format check, a length penalty and DAPO's soft overlong penalty.

    {fn: format, kwargs: {pattern: "<reasoning>.*</reasoning>\\s*<answer>.*</answer>"}}
    {fn: length_penalty, kwargs: {max_length: 512, coef: 0.1}}
    {fn: overlong, kwargs: {max_length: 512, buffer: 128}}

Lengths are in tokens: they come from the `completion_ids` column, which the
RL loop passes with every batch (characters would punish a model for
writing digits rather than words).
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def format(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    pattern: str,
    match_reward: float = 1.0,
    mismatch_reward: float = 0.0,
    full_match: bool = True,
    **_columns,
) -> list[float]:
    """`match_reward` where `pattern` matches the completion (all of it by default; `.` matches newlines)."""
    regex = re.compile(pattern, flags=re.DOTALL)
    match = regex.fullmatch if full_match else regex.search
    return [match_reward if match(c) else mismatch_reward for c in completions]


def _token_lengths(completions: Sequence[str], completion_ids: Sequence[Sequence[int]] | None, name: str) -> list[int]:
    if completion_ids is None:
        raise ValueError(f"the {name} reward measures tokens and needs the `completion_ids` column")
    if len(completion_ids) != len(completions):
        raise ValueError(f"{len(completion_ids)} completion_ids for {len(completions)} completions")
    return [len(ids) for ids in completion_ids]


def length_penalty(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_length: int,
    coef: float = 0.1,
    completion_ids: Sequence[Sequence[int]] | None = None,
    **_columns,
) -> list[float]:
    """`-coef * min(tokens, max_length) / max_length`: from 0 (empty) to -coef (max_length or longer)."""
    return [
        -coef * min(n, max_length) / max_length for n in _token_lengths(completions, completion_ids, "length_penalty")
    ]


def overlong(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_length: int,
    buffer: int,
    penalty: float = 1.0,
    completion_ids: Sequence[Sequence[int]] | None = None,
    **_columns,
) -> list[float]:
    """DAPO soft overlong punishment (tokens): 0 up to `max_length - buffer`, then linear to -penalty at
    `max_length`."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong: need 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}")
    safe = max_length - buffer
    out = []
    for n in _token_lengths(completions, completion_ids, "overlong"):
        if n <= safe:
            out.append(0.0)
        elif n <= max_length:
            out.append(-penalty * (n - safe) / buffer)
        else:
            out.append(-penalty)
    return out
