"""`gsm8k`: the format + answer reward of the MaxText/Tunix GSM8K GRPO recipes.

A completion is expected to look like

    <reasoning> ... </reasoning> <answer> 72 </answer>

and its reward is the sum of a format term and an answer term:

format  all of it, in order, each tag once, nothing around  reward_exact_format_match
        otherwise, per tag: present exactly once / not     +reward_partial_format_match / +penalty_incorrect_format
answer  (only when the <answer> tags are there)
        identical to the gold answer                        reward_exact_answer
        identical after stripping whitespace, or the same
          number written differently (1,234 / $1234 / 72.0) reward_white_space_format_match
        guess / gold within [0.9, 1.1]                      reward_ratio_guess_to_answer_high
        guess / gold within [0.8, 1.2]                      reward_ratio_guess_to_answer_low
        another number                                      penalty_incorrect_answer
        not a number                                        penalty_incorrect_format

The gold answer is GSM8K's `answer` column (the part after `####`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rewards.extract import between_tags, gsm8k_gold, to_number


def gsm8k(
    prompts: Sequence[str],
    completions: Sequence[str],
    answer: Sequence[str],
    *,
    reasoning_start_token: str = "<reasoning>",
    reasoning_end_token: str = "</reasoning>",
    solution_start_token: str = "<answer>",
    solution_end_token: str = "</answer>",
    reward_exact_answer: float = 3.0,
    reward_white_space_format_match: float = 1.5,
    reward_exact_format_match: float = 3.0,
    reward_partial_format_match: float = 0.5,
    reward_ratio_guess_to_answer_high: float = 0.5,
    reward_ratio_guess_to_answer_low: float = 0.25,
    penalty_incorrect_format: float = -0.5,
    penalty_incorrect_answer: float = -1.0,
    **_columns,
) -> list[float]:
    tags = (reasoning_start_token, reasoning_end_token, solution_start_token, solution_end_token)
    exact_format = re.compile(
        rf"\s*{re.escape(tags[0])}.+?{re.escape(tags[1])}.*?{re.escape(tags[2])}(.+?){re.escape(tags[3])}\s*",
        flags=re.DOTALL,
    )

    def format_term(text: str) -> float:
        if exact_format.fullmatch(text) and all(text.count(t) == 1 for t in tags):
            return reward_exact_format_match
        return sum(reward_partial_format_match if text.count(t) == 1 else penalty_incorrect_format for t in tags)

    def answer_term(text: str, gold: str) -> float:
        guess_raw = between_tags(text, solution_start_token, solution_end_token, strip=False)
        if guess_raw is None:
            return 0.0  # the format term already penalises the missing tags
        guess = guess_raw.strip()
        if guess_raw == gold:
            return reward_exact_answer
        if guess == gold.strip():
            return reward_white_space_format_match
        guess_value, gold_value = to_number(guess), to_number(gold)
        if guess_value is None or gold_value is None:
            return penalty_incorrect_format
        if guess_value == gold_value:
            return reward_white_space_format_match
        if gold_value == 0:
            return penalty_incorrect_answer
        ratio = guess_value / gold_value
        if 0.9 <= ratio <= 1.1:
            return reward_ratio_guess_to_answer_high
        if 0.8 <= ratio <= 1.2:
            return reward_ratio_guess_to_answer_low
        return penalty_incorrect_answer

    return [format_term(c) + answer_term(c, gsm8k_gold(str(g))) for c, g in zip(completions, answer)]
