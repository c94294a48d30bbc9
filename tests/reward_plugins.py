"""Reward plugins for tests/test_rewards.py: some behave, some misbehave when a completion asks them to."""

import os
import time


def char_count(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def uses_answer(prompts, completions, answer, bonus=0.0, **_):
    return [float(c == a) + bonus for c, a in zip(completions, answer)]


def raises_on_trigger(prompts, completions, **_):
    if any("raise" in c for c in completions):
        raise RuntimeError("plugin exploded")
    return [1.0] * len(completions)


def hangs_on_trigger(prompts, completions, **_):
    if any("hang" in c for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def aborts_on_trigger(prompts, completions, **_):
    if any("abort" in c for c in completions):
        os.abort()
    return [1.0] * len(completions)


def wrong_length_on_trigger(prompts, completions, **_):
    extra = 1 if any("long" in c for c in completions) else 0
    return [1.0] * (len(completions) + extra)


def nan_on_trigger(prompts, completions, **_):
    return [float("nan") if "nan" in c else 1.0 for c in completions]


def words_on_trigger(prompts, completions, **_):
    return ["high" if "word" in c else 1.0 for c in completions]


not_a_function = 3


def by_prompt_length(prompts, completions, **_):
    """The same reward for every completion of a prompt: every group has zero variance."""
    return [float(len(p) % 2) for p in prompts]


def digit_share(prompts, completions, **_):
    """Share of a completion's non-space characters that are digits: a reward a random tiny model can learn."""
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / max(len(chars), 1))
    return out


def fails_on_first_prompt(prompts, completions, **_):
    """NaN (a failure) for the completions of the batch's first prompt, the completion's length elsewhere."""
    return [float("nan") if p == prompts[0] else float(len(c)) for p, c in zip(prompts, completions)]


def verdict_chars(verdict):
    """A judge's verdict parser (`rewards.judge`): its length in characters, which any verdict has."""
    return float(len(verdict))


class FlakyEnvironment:
    """An environment whose first reset, or first step, of a row fails (a mark in a file under `dir`, shared by the
    worker processes): `flaky: reset` raises there, `flaky: hang` hangs its first step (a lost server), `flaky:
    raise` raises at every step (a step that may be the model's doing)."""

    def __init__(self, dir: str):
        from pathlib import Path

        self.dir = Path(dir)

    def _first(self, what: str, row: dict) -> bool:
        import zlib

        mark = self.dir / f"{what}-{zlib.crc32(str(row['prompt']).encode())}"
        first = not mark.exists()
        mark.touch()
        return first

    def reset(self, row):
        from rollout.environment import EnvStart

        if row.get("flaky") == "reset" and self._first("reset", row):
            raise ConnectionError("the environment server went away")
        return EnvStart([{"role": "user", "content": str(row["prompt"])}], state=dict(row))

    def step(self, state, turn):
        import time

        from rollout.environment import EnvReply

        if state.get("flaky") == "hang" and self._first("step", state):
            time.sleep(600)
        if state.get("flaky") == "raise":
            raise ValueError(f"cannot read {turn.content!r} as a move")
        return EnvReply(done=True, reward=1.0, state=state)


class WhereAmI:
    """Says which process runs it (a worker of the pool)."""

    def pid(self) -> int:
        return os.getpid()
