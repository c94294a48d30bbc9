"""Find the final answer in a completion: `\\boxed{...}`, solution tags, or the last number.

Pure string functions, linear in the completion length (completions can be
megabytes of garbage), shared by the math_verify, gsm8k and reasoning_gym rewards.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# 1,234.5   -7   3/4   .5 is not matched (GSM8K answers are written with a leading digit)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_BOX_OPENERS = ("\\boxed{", "\\fbox{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, or None."""
    start = max(text.rfind(opener) + len(opener) if opener in text else -1 for opener in _BOX_OPENERS)
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None  # unbalanced: no answer


def between_tags(text: str, start_tag: str, end_tag: str, strip: bool = True) -> str | None:
    """Content between the last `start_tag` and the `end_tag` after it, or None."""
    begin = text.rfind(start_tag)
    if begin < 0:
        return None
    begin += len(start_tag)
    end = text.find(end_tag, begin)
    if end < 0:
        return None
    return text[begin:end].strip() if strip else text[begin:end]


def last_number(text: str) -> str | None:
    """The last number in the text (thousands separators and a `/d` fraction allowed), or None."""
    matches = list(_NUMBER.finditer(text))
    return matches[-1].group(0) if matches else None


def last_line(text: str) -> str | None:
    """The last non-empty line, without an `Answer:` / `Final answer =` prefix, or None."""
    lines = text.strip().splitlines()
    if not lines:
        return None
    return re.sub(r"^(?:final )?answer\s*[:=]\s*", "", lines[-1].strip(), flags=re.IGNORECASE)


def final_answer(
    text: str,
    solution_start: str = "<answer>",
    solution_end: str = "</answer>",
    max_chars: int = 256,
    fallback: Callable[[str], str | None] = last_number,
) -> str | None:
    """The completion's final answer: boxed, else between the solution tags, else `fallback` (the last number).

    Returns None when there is none or it is longer than `max_chars` (long "answers"
    are never worth handing to a symbolic parser).
    """
    answer = last_boxed(text)
    if answer is None:
        answer = between_tags(text, solution_start, solution_end)
    if answer is None:
        answer = fallback(text)
    if answer is None or not answer or len(answer) > max_chars:
        return None
    return answer


def gsm8k_gold(answer: str) -> str:
    """GSM8K's `answer` column ends with `#### 72`: keep what follows the last `####`."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def to_number(text: str) -> float | None:
    """A plain number written with optional `$`, thousands separators, `%` or units after it; else None."""
    cleaned = text.strip().replace(",", "").lstrip("$").strip()
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(\d+))?\s*(?:%|[A-Za-z ]{0,20})?\.?", cleaned)
    if match is None:
        return None
    value = float(match.group(1))
    if match.group(2) is not None:
        denominator = float(match.group(2))
        return None if denominator == 0 else value / denominator
    return value
