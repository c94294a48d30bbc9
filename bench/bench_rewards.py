"""Reward functions for the benchmarks: rewards that random models score with variance in every group, so that
every group's advantages are non-zero and a GRPO step does all its work (a math reward scores a random model's
every completion 0: flat groups, zero advantages, an update with nothing to learn, on both sides of a
comparison)."""


def char_length(prompts, completions, **_):
    """A length reward: the completion's characters / 64. Completions of the same token count differ in characters,
    so no group of a random model's samples scores flat."""
    return [len(c) / 64.0 for c in completions]


def digit_share(prompts, completions, **_):
    """Share of a completion's non-space characters that are digits (an arithmetic answer's are all digits): a
    random model scores 0 on some prompts with every sample (flat groups: 2 to 4 of 32 at ~100M)."""
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / max(len(chars), 1))
    return out


def final_answer(prompts, completions, answer, **_):
    """1 when the final turn's text is the answer, else 0 (an agent's completion: Temper passes the last turn's text,
    TRL the conversation's messages, whose last assistant message is the final turn)."""
    out = []
    for c, a in zip(completions, answer):
        if not isinstance(c, str):
            c = next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")
        out.append(float(c.strip() == str(a).strip()))
    return out


def answer_closeness(prompts, completions, answer, **_):
    """1 for the exact answer in the final turn; else half of exp(-relative error) of the last number it holds (0
    without one): an arithmetic agent's group of samples rarely scores flat, so every step carries an advantage
    (the exact-answer reward left whole steps flat with a model that solves most problems or none)."""
    import math
    import re

    out = []
    for c, a in zip(completions, answer):
        if not isinstance(c, str):
            c = next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")
        if c.strip() == str(a).strip():
            out.append(1.0)
            continue
        numbers = re.findall(r"-?\d+(?:\.\d+)?", c)
        if not numbers:
            out.append(0.0)
            continue
        target = float(a)
        error = abs(float(numbers[-1]) - target) / max(1.0, abs(target))
        out.append(0.5 * math.exp(-error))
    return out
