"""Held-out evaluation for RL: greedy pass@1, and pass@k (unbiased) and maj@k from sampled completions.

pass@k is the probability that at least one of k completions drawn without
replacement from the n sampled ones is correct (Chen et al., 2021):
    pass@k = 1 - C(n - c, k) / C(n, k)
maj@k: the most frequent final answer among k samples (ties: the first one
seen) is correct. `held_out_metrics` scores a run's held-out completions with its accuracy function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb
from typing import Any

import numpy as np

from posttrain.onpolicy.prompts import columns_of, prompt_text
from rewards.extract import final_answer
from rollout.sampler import Completion


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Is the most common (non-empty) answer correct? Answers are compared as normalised strings."""
    normalised = [None if a is None else " ".join(a.split()) for a in answers]
    votes = Counter(a for a in normalised if a)
    if not votes:
        return False
    top = votes.most_common(1)[0][0]
    return any(ok for a, ok in zip(normalised, correct) if a == top)


def eval_metrics(
    greedy_ok: np.ndarray, sampled_ok: np.ndarray, sampled_answers: Sequence[str | None]
) -> dict[str, float]:
    """The held-out figures from greedy correctness (one per prompt) and sampled correctness (prompts x k, with the
    final answers of the samples in that order): pass@1 (greedy), pass@k (k > 1: with one sample it is the sampled
    pass@1, and its name would be the greedy one's), sampled pass@1 and maj@k."""
    n, k = sampled_ok.shape
    out = {"eval/pass@1": float(greedy_ok.mean())}
    if k > 1:
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(k, int(r.sum()), k) for r in sampled_ok]))
    return {
        **out,
        "eval/sampled_pass@1": float(sampled_ok.mean()),
        f"eval/maj@{k}": float(
            np.mean([majority_correct(sampled_answers[i * k : (i + 1) * k], sampled_ok[i]) for i in range(n)])
        ),
    }


def held_out_metrics(
    rows: Sequence[dict], rl: Any, greedy: Sequence[Completion], sampled: Sequence[Completion], rewards: Any
) -> dict[str, float]:
    """`eval_metrics` of a run's held-out `rows`: one greedy completion a row and `rl.eval_samples` sampled ones
    (row-major), correct where `rl.accuracy_fn` (scored by the run's `rewards.runner.RewardRunner`) is > 0."""
    k = rl.eval_samples
    texts = [prompt_text(r, rl) for r in rows]
    ok_greedy = rewards.score_fn(rl.accuracy_fn, texts, [c.text for c in greedy], columns_of(rows, 1)) > 0
    ok_sampled = (
        rewards.score_fn(
            rl.accuracy_fn, [t for t in texts for _ in range(k)], [c.text for c in sampled], columns_of(rows, k)
        )
        > 0
    ).reshape(-1, k)
    return eval_metrics(ok_greedy, ok_sampled, [final_answer(c.text) for c in sampled])
