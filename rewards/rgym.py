"""`reasoning_gym`: score with the generating task's own checker (`score_answer`).

Rows made by `core.data` from `reasoning_gym:TASK` carry `answer` and a JSON
`metadata` column that names the source task, so every generated dataset gets
its exact checker. The answer is `\\boxed{...}`, else the text between the
solution tags, else the completion's last line (without an `Answer:` prefix);
an empty or over-long answer scores 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from rewards.extract import final_answer, last_line


def reasoning_gym(
    prompts: Sequence[str],
    completions: Sequence[str],
    answer: Sequence[str],
    metadata: Sequence[str | dict],
    *,
    solution_start: str = "<answer>",
    solution_end: str = "</answer>",
    max_answer_chars: int = 1024,
    **_columns,
) -> list[float]:
    import reasoning_gym as rg

    out = []
    for completion, gold, meta in zip(completions, answer, metadata):
        meta = json.loads(meta) if isinstance(meta, str) else dict(meta)
        score = rg.get_score_answer_fn(meta["source_dataset"])
        guess = final_answer(completion, solution_start, solution_end, max_answer_chars, fallback=last_line)
        out.append(0.0 if guess is None else float(score(guess, {"answer": gold, "metadata": meta})))
    return out
