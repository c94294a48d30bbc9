"""Preference pairs: rows -> token ids -> the typed batch DPO-family losses train on (pure NumPy).

    pairs, dropped = tokenize_pairs(records, tokenizer, data_format="prompt_completion", seq_len=512)
    batch = build_pair_batch([pairs[i] for i in chosen_rows], slots=8, row_len=512, groups=2)
    batch.packed        # core.batch.PackedBatch: scored sequence 2i = pair i's chosen, 2i + 1 its rejected
    batch.pair_mask     # [P] 1 for a real pair, 0 for an empty slot (a short last eval batch)
    batch.ref_chosen, batch.ref_rejected    # [P] summed reference log-probs, or None (filled in later)

Rows (`data.format`):

- `prompt_completion`: `prompt`, `chosen`, `rejected` strings. The prompt as a model is given it (with the
  tokenizer's BOS, if it adds one), each completion alone plus EOS (`core.encoding`).
- `chat`: `prompt` a list of messages (system / user / assistant / tool turns: a multi-turn, hh-rlhf-style prompt
  holds earlier assistant turns), `chosen` and `rejected` each a list holding one assistant message; or, without
  `prompt`, `chosen` and `rejected` whole conversations that share every message but their last (the implicit
  prompt, as TRL reads it). The prompt is the conversation rendered with a generation prompt, what a sampler gives
  the model; a completion is the last assistant turn's tokens in the rendering of the whole conversation, through
  its end-of-turn token (`core.chat.split_last_turn`: any template the model families ship).

Chosen and rejected share one copy of their prompt: the pair is one segment, the prompt its prefix (branch 0) and
the two completions branches 1 and 2, each attending to the prompt and to itself only (`core.packing`), so the
prompt is encoded once. Prompts longer than `max_prompt_tokens` keep their end; completions longer than
`max_completion_tokens` keep their start. A row with a missing or mistyped field, identical chosen and rejected,
an empty completion, a conversation its template cannot split, or more than `seq_len` tokens in all is an error
naming it, or skipped and counted with `skip_malformed`; a pair whose two completions become identical once
truncated carries no preference and is dropped (counted, said at start-up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from core.batch import PackedBatch
from core.data import MalformedRow, messages_problem
from core.encoding import encode_completion, encode_prompt
from core.packing import Segment, branch_targets, pack_rows, packed_batch
from core.shapes import bucketed_width


@dataclass(frozen=True)
class Pair:
    row: int  # the source row
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    # Per token of chosen / rejected: the model's (True, a target) or an environment's (False: context, in a
    # multi-turn trajectory); None: every token is the model's.
    chosen_trained: tuple[bool, ...] | None = None
    rejected_trained: tuple[bool, ...] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PairBatch:
    packed: PackedBatch  # [2P, C] targets: 2i chosen, 2i + 1 rejected
    pair_mask: Any  # [P] float32
    ref_chosen: Any = None  # [P] float32 sum of the reference's log-probs over the chosen completion
    ref_rejected: Any = None

    def replace(self, **changes: Any) -> PairBatch:
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------ rows


def chat_sides(row: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a chat pair row: an explicit `prompt`, or the messages the two whole
    conversations share (the implicit prompt)."""
    if row.get("prompt") is not None:
        return row["prompt"], row["chosen"], row["rejected"]
    chosen, rejected = row["chosen"], row["rejected"]
    return chosen[:-1], chosen[-1:], rejected[-1:]


def _row_problem(row: Any, data_format: str) -> str | None:
    if not isinstance(row, dict):
        return f"expected a mapping, got {type(row).__name__}"
    needed = ("chosen", "rejected") if data_format == "chat" else ("prompt", "chosen", "rejected")
    for name in needed:
        if row.get(name) is None:
            return f"field '{name}': missing"
    if data_format == "prompt_completion":
        for name in ("prompt", "chosen", "rejected"):
            if not isinstance(row[name], str):
                return f"field '{name}': expected a string, got {type(row[name]).__name__}"
        if not row["chosen"].strip() or not row["rejected"].strip():
            return "field 'chosen' or 'rejected': empty text"
    else:
        for name in ("prompt", "chosen", "rejected"):
            if name in row and row[name] is not None and (bad := messages_problem(row, name)) is not None:
                return f"field '{bad[0]}': {bad[1]}"
        if row.get("prompt") is None:  # whole conversations: they must share all but their last message
            chosen, rejected = row["chosen"], row["rejected"]
            if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
                return (
                    "without a 'prompt' field, 'chosen' and 'rejected' must be whole conversations that share "
                    "every message but their last"
                )
        else:
            for name in ("chosen", "rejected"):
                if len(row[name]) != 1:
                    return f"field '{name}': expected a list of one assistant message (the prompt holds the rest)"
        for name, side in zip(("chosen", "rejected"), chat_sides(row)[1:]):
            if side[-1]["role"] != "assistant":
                return f"field '{name}': its last message must be an assistant turn"
    if row["chosen"] == row["rejected"]:
        return "chosen and rejected are identical (the pair carries no preference)"
    return None


def _chat_pair(tok: Any, row: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of a chat pair: the prompt with a generation prompt (and the row's
    `tools`, rendered by the template), each completion its last assistant turn through the end-of-turn token (a
    tool call is part of it, as the template writes it)."""
    from core.chat import split_last_turn

    prompt, chosen, rejected = chat_sides(row)
    tools = row.get("tools")
    prompt_ids, chosen_ids = split_last_turn(tok, [*prompt, *chosen], tools)
    _, rejected_ids = split_last_turn(tok, [*prompt, *rejected], tools)
    return prompt_ids, chosen_ids, rejected_ids


def tokenize_pairs(
    records: Sequence[dict],
    tok: Any,
    *,
    data_format: str,
    seq_len: int,
    max_prompt_tokens: int | None = None,
    max_completion_tokens: int | None = None,
    skip_malformed: bool = False,
    source: str = "<records>",
    rows: Sequence[int] | None = None,
) -> tuple[list[Pair], list[str], list[str]]:
    """(every usable row as a `Pair`, a description of each skipped row, of each dropped pair). A malformed row
    raises `MalformedRow` naming it unless `skip_malformed`; a pair whose completions are identical once truncated
    is dropped either way (it carries no preference)."""
    from core.errors import UserError

    pairs, skipped, dropped = [], [], []
    for i in range(len(records)) if rows is None else rows:
        row = records[i]
        problem = _row_problem(row, data_format)
        if problem is None:
            try:
                if data_format == "prompt_completion":
                    prompt = encode_prompt(tok, row["prompt"])
                    chosen = encode_completion(tok, row["chosen"])
                    rejected = encode_completion(tok, row["rejected"])
                else:
                    prompt, chosen, rejected = _chat_pair(tok, row)
            except UserError as err:  # a template that cannot render or split the conversation
                problem = str(err)
        if problem is None:
            if max_prompt_tokens is not None:
                prompt = prompt[-max_prompt_tokens:]
            if max_completion_tokens is not None:
                chosen, rejected = chosen[:max_completion_tokens], rejected[:max_completion_tokens]
            pair = Pair(i, tuple(prompt), tuple(chosen), tuple(rejected))
            if not prompt:
                problem = "empty prompt (a completion needs a token to follow)"
            elif pair.chosen == pair.rejected:
                dropped.append(
                    f"{source}: row {i}: chosen and rejected are identical once truncated to "
                    f"dpo.max_completion_tokens={max_completion_tokens}"
                )
                continue
            elif pair.length > seq_len:
                problem = (
                    f"prompt {len(prompt)} + chosen {len(chosen)} + rejected {len(rejected)} tokens > "
                    f"data.seq_len={seq_len} (set dpo.max_prompt_tokens / dpo.max_completion_tokens)"
                )
        if problem is not None:
            message = f"{source}: row {i}: {problem}"
            if not skip_malformed:
                raise MalformedRow(message + " (set data.skip_malformed=true to skip such rows)")
            skipped.append(message)
            continue
        pairs.append(pair)
    return pairs, skipped, dropped


# ----------------------------------------------------------------- batch


def build_pair_batch(
    pairs: Sequence[Pair],
    *,
    slots: int,
    row_len: int,
    groups: int = 1,
    pack: bool = True,
    row_multiple: int = 1,
    pad_id: int = 0,
) -> PairBatch:
    """`pairs` in `slots` pair slots (the rest empty), cut into `groups` packing groups (micro-batches) of
    slots / groups pairs each; the target axis C is the longest completion, bucketed (`core.shapes.bucketed_width`)."""
    if len(pairs) > slots or slots % groups:
        raise ValueError(f"{len(pairs)} pairs in {slots} slots, {groups} groups: need pairs <= slots, divisible")
    per_group = slots // groups
    members = [list(pairs[g * per_group : (g + 1) * per_group]) for g in range(groups)]
    segments = [[Segment(p.prompt, (p.chosen, p.rejected)) for p in group] for group in members]
    rows = pack_rows(segments, row_len, pack=pack, row_multiple=row_multiple, pad_id=pad_id)
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    targets = [empty] * (2 * slots)
    mask = np.zeros(slots, np.float32)
    for g, group in enumerate(members):
        for s in range(len(group)):
            slot = g * per_group + s
            targets[2 * slot] = branch_targets(rows, g, s, 1)
            targets[2 * slot + 1] = branch_targets(rows, g, s, 2)
            mask[slot] = 1.0
    longest = max((max(len(p.chosen), len(p.rejected)) for p in pairs), default=1)
    packed = packed_batch(rows, targets, bucketed_width(longest, row_len))
    for g, group in enumerate(members):  # an environment's tokens in a trajectory: context, not targets
        for s, p in enumerate(group):
            slot = g * per_group + s
            for side, trained in ((0, p.chosen_trained), (1, p.rejected_trained)):
                if trained is not None:
                    packed.target_mask[2 * slot + side, : len(trained)] *= np.asarray(trained, np.float32)
    return PairBatch(packed, mask)
