"""RL prompts: dataset rows -> rendered prompts, a resumable shuffled stream, and a held-out split.

    train_rows, eval_rows = prompt_rows(cfg)
    stream = PromptStream(train_rows, cfg.rl.batch.prompts_per_step, seed=cfg.data.seed)
    batch = next(stream)                  # PromptBatch: .indices into train_rows, .rows (dicts)
    stream.get_state() / set_state(state) # for resume; stream.batch(indices) rebuilds a batch
    prompt = render_prompt(rows[0], cfg.rl)

Every row must have the fields `rl.prompt_template` names (e.g. `{question}`);
the other fields (e.g. `answer`, `metadata`) travel with it to the reward
functions as columns. `data.eval_fraction` of the rows (the last ones) are
held out for evaluation.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.data import MalformedRow, epochs, held_out
from core.sources import DataSourceError, load_records
from posttrain.config import PostTrainConfig, RLConfig


def template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def prompt_rows(cfg: PostTrainConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of `data.source`, checked against the prompt template; the held-out rows are the
    last `data.eval_fraction` of the usable ones (`core.data.held_out`)."""
    if cfg.data.source is None:
        raise DataSourceError("data.source is not set: an on-policy method needs prompts")
    records = load_records(cfg.data)
    fields = template_fields(cfg.rl.prompt_template)
    rows, skipped = [], 0
    for i in range(len(records)):
        row = dict(records[i])
        missing = [f for f in fields if not isinstance(row.get(f), str) or not row[f].strip()]
        if missing:
            message = (
                f"{cfg.data.source}: row {i}: field '{missing[0]}' (used by rl.prompt_template) is missing or empty"
            )
            if not cfg.data.skip_malformed:
                raise MalformedRow(message + " (set data.skip_malformed=true to skip such rows)")
            skipped += 1
            continue
        rows.append(row)
    if not rows:
        raise MalformedRow(f"{cfg.data.source}: no usable rows ({skipped} malformed)")
    return held_out(rows, cfg.data.eval_fraction)


def prompt_text(row: dict, rl: RLConfig) -> str:
    """The formatted template: what reward functions see as the prompt."""
    return rl.prompt_template.format(**row)


def render_prompt(row: dict, rl: RLConfig) -> str | list[dict]:
    """The prompt the sampler gets: the formatted template, as a user turn when the chat template is on."""
    text = prompt_text(row, rl)
    return [{"role": "user", "content": text}] if rl.use_chat_template else text


def columns_of(rows: Sequence[dict], repeat: int) -> dict[str, list[Any]]:
    """Reward columns: every row field, each value repeated for the row's `repeat` completions."""
    keys = set().union(*(r.keys() for r in rows))
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in sorted(keys)}


@dataclass(frozen=True)
class PromptBatch:
    indices: list[int]  # positions in the training rows (what a checkpoint stores)
    rows: list[dict]


class PromptStream:
    """Batches of rows, reshuffled every epoch (Grain), with a JSON-serialisable position."""

    def __init__(self, rows: Sequence[dict], batch_size: int, seed: int, shuffle: bool = True):
        if len(rows) < batch_size:
            raise DataSourceError(
                f"{len(rows)} training prompts cannot fill a batch of {batch_size} (rl.batch.prompts_per_step)"
            )
        self._rows = rows
        self._it = iter(epochs(len(rows), seed=seed, shuffle=shuffle).batch(batch_size, drop_remainder=True))

    def __iter__(self):
        return self

    def __next__(self) -> PromptBatch:
        return self.batch([int(i) for i in next(self._it)])

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        return PromptBatch(list(indices), [self._rows[i] for i in indices])

    def get_state(self) -> dict:
        return self._it.get_state()

    def set_state(self, state: dict) -> None:
        self._it.set_state(state)
