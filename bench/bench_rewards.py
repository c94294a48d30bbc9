"""Reward functions for the benchmarks: rewards that random models score with variance, so that every group's
advantages are non-zero and a GRPO step does all its work (a math reward scores a random model's every
completion 0: flat groups, zero advantages, nothing to learn, on both sides of a comparison)."""


def digit_share(prompts, completions, **_):
    """Share of a completion's non-space characters that are digits (an arithmetic answer's are all digits): a
    random tiny model's completions score from 0 to 1, differently within a group."""
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / max(len(chars), 1))
    return out
