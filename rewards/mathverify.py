"""`math_verify`: is the completion's final answer mathematically equal to the gold answer?

    reward.functions: [{fn: math_verify, kwargs: {solution_start: "<answer>", solution_end: "</answer>"}}]

The answer is `\\boxed{...}`, else the text between the solution tags, else the
last number (`rewards.extract.final_answer`), capped at `max_answer_chars`.
Gold and answer are parsed and compared by math-verify. Runs in a reward
worker process: math-verify's own timeouts use `signal.alarm`, which only
works in a process's main thread.

Two guards keep the reward deterministic and cheap:
- undefined answers (`0/0`, `\\frac{1}{0}`) never match. Plain math-verify
  judges an unboxed `0/0` equal to `0`, and whether it does depends on what
  the process compared before;
- answers that would make sympy compute a huge number (`9^{9^{9}}`, a 100-digit
  literal) score as wrong without being parsed: big-integer arithmetic runs
  in C, where neither `signal.alarm` nor a Python timeout can stop it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rewards.extract import final_answer, gsm8k_gold

_POWER = re.compile(r"\^|\*\*")
_LONG_DIGITS = re.compile(r"\d{40,}")
_FACTORIAL = re.compile(r"\d{3,}\s*!")


def too_expensive(answer: str) -> bool:
    """Would parsing this answer risk an unbounded big-number computation?"""
    return len(_POWER.findall(answer)) > 1 or bool(_LONG_DIGITS.search(answer)) or bool(_FACTORIAL.search(answer))


def is_undefined(parsed: list) -> bool:
    """True when a parsed expression divides by zero (sympy nan / zoo, or an unevaluated x/0)."""
    import sympy

    for expr in parsed:
        if not isinstance(expr, sympy.Basic):
            continue
        if expr.has(sympy.nan, sympy.zoo):
            return True
        if any(p.base == 0 and p.exp.is_negative for p in expr.atoms(sympy.Pow)):
            return True
    return False


def parse_answer(text: str, timeout: int) -> list:
    from math_verify import parse

    parsed = parse(text, parsing_timeout=timeout)
    if not parsed:  # bare LaTeX such as \frac12 parses once it is in math mode
        parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed


def is_equivalent(gold: str, answer: str, timeout: int = 2) -> bool:
    from math_verify import verify

    if too_expensive(answer) or too_expensive(gold):
        return False
    gold_parsed = parse_answer(gold, timeout)
    answer_parsed = parse_answer(answer, timeout)
    if not gold_parsed or not answer_parsed or is_undefined(answer_parsed):
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))


def math_verify(
    prompts: Sequence[str],
    completions: Sequence[str],
    answer: Sequence[str],
    *,
    solution_start: str = "<answer>",
    solution_end: str = "</answer>",
    max_answer_chars: int = 256,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
    timeout_seconds: int = 2,
    **_columns,
) -> list[float]:
    rewards = []
    for completion, gold in zip(completions, answer):
        extracted = final_answer(completion, solution_start, solution_end, max_answer_chars)
        ok = extracted is not None and is_equivalent(gsm8k_gold(str(gold)), extracted, timeout_seconds)
        rewards.append(correct_reward if ok else incorrect_reward)
    return rewards
