"""Completions + advantages -> the padded arrays the policy objective trains on (pure NumPy).

Row i is prompt_i + completion_i, right-padded to `seq_len` (a fixed length,
so the jitted step compiles once). Targets are tokens[:, 1:], so completion
token j of a row with prompt length P is target index P - 1 + j; `loss_mask`,
`sampler_logp` and the log-prob arrays the trainer fills in later are
indexed by target. See `posttrain/objective.py` for the layout.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rollout.sampler import Completion


def build_rl_batch(
    completions: Sequence[Completion],
    advantages: np.ndarray,
    keep: np.ndarray,
    seq_len: int,
    mask_truncated: bool = False,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Arrays for `posttrain.objective`: tokens, positions, segment_ids, loss_mask, advantages, sampler_logp,
    plus `completion_mask` (every completion token, kept or not: for statistics, not for the loss).

    `keep` (e.g. False for zero-variance groups) and, with `mask_truncated`
    (DAPO), completions that hit the length limit contribute no loss tokens.
    """
    b = len(completions)
    tokens = np.full((b, seq_len), pad_id, np.int32)
    segment_ids = np.zeros((b, seq_len), np.int32)
    loss_mask = np.zeros((b, seq_len - 1), np.float32)
    completion_mask = np.zeros((b, seq_len - 1), np.float32)
    sampler_logp = np.zeros((b, seq_len - 1), np.float32)
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.token_ids)
        if p + n > seq_len:
            raise ValueError(f"completion {i}: prompt {p} + completion {n} tokens > seq_len {seq_len}")
        tokens[i, :p] = c.prompt_ids
        tokens[i, p:p + n] = c.token_ids
        segment_ids[i, :p + n] = 1
        if c.logprobs is not None:
            sampler_logp[i, p - 1:p - 1 + n] = c.logprobs
        completion_mask[i, p - 1:p - 1 + n] = 1.0
        counts = bool(keep[i]) and not (mask_truncated and c.finish_reason == "length")
        if counts:
            loss_mask[i, p - 1:p - 1 + n] = 1.0
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (b, seq_len)).copy()
    return {
        "tokens": tokens, "positions": positions, "segment_ids": segment_ids, "loss_mask": loss_mask,
        "advantages": np.asarray(advantages, np.float32), "sampler_logp": sampler_logp,
        "completion_mask": completion_mask,
    }
