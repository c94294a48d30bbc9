"""Preference pairs: rows -> token ids -> the typed batch DPO-family losses train on (pure NumPy).

    pairs, skipped = tokenize_pairs(records, tokenizer, data_format="prompt_completion", seq_len=512)
    batch = build_pair_batch([pairs[i] for i in chosen_rows], slots=8, row_len=512, groups=2)
    batch.packed        # core.batch.PackedBatch: scored sequence 2i = pair i's chosen, 2i + 1 its rejected
    batch.pair_mask     # [P] 1 for a real pair, 0 for an empty slot (a short last eval batch)
    batch.ref_chosen, batch.ref_rejected    # [P] summed reference log-probs, or None (filled in later)

Rows (`data.format`):

- `prompt_completion`: `prompt`, `chosen`, `rejected` strings. The prompt is
  tokenized alone, each completion alone plus EOS (as TRL does).
- `chat`: `prompt` a list of messages (system / user / assistant turns),
  `chosen` and `rejected` each a list holding one assistant message, rendered
  with the tokenizer's chat template (`core.chat`): the prompt is the
  conversation up to the generation prompt, a completion is the assistant
  turn's tokens through its end-of-turn token.

Chosen and rejected share one copy of their prompt: the pair is one segment,
the prompt its prefix (branch 0) and the two completions branches 1 and 2,
each attending to the prompt and to itself only (`core.packing`), so the
prompt is encoded once. Prompts longer than `max_prompt_tokens` keep their
end; completions longer than `max_completion_tokens` keep their start. A row
with a missing or mistyped field, identical chosen and rejected, an empty
completion, or more than `seq_len` tokens in all is an error naming it, or
skipped and counted with `skip_malformed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from core.batch import PackedBatch
from core.data import MalformedRow
from core.packing import Segment, branch_targets, pack_rows, packed_batch
from core.shapes import bucketed_width


@dataclass(frozen=True)
class Pair:
    row: int  # the source row
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]

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

    @property
    def tokens(self) -> Any:  # what the loop counts as the step's tokens
        return self.packed.tokens

    def replace(self, **changes: Any) -> PairBatch:
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------ rows


def _row_problem(row: Any, data_format: str) -> str | None:
    if not isinstance(row, dict):
        return f"expected a mapping, got {type(row).__name__}"
    for name in ("prompt", "chosen", "rejected"):
        if row.get(name) is None:
            return f"field '{name}': missing"
    if data_format == "prompt_completion":
        for name in ("prompt", "chosen", "rejected"):
            if not isinstance(row[name], str):
                return f"field '{name}': expected a string, got {type(row[name]).__name__}"
        if not row["chosen"].strip() or not row["rejected"].strip():
            return "field 'chosen' or 'rejected': empty text"
    else:
        if not isinstance(row["prompt"], list) or not row["prompt"]:
            return "field 'prompt': expected a non-empty list of messages"
        for name in ("chosen", "rejected"):
            value = row[name]
            if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)):
                return f"field '{name}': expected a list of one assistant message"
            if value[0].get("role") != "assistant" or not isinstance(value[0].get("content"), str):
                return f"field '{name}': expected {{role: assistant, content: str}}"
        for j, m in enumerate(row["prompt"]):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"field 'prompt[{j}]': expected {{role: str, content: str}}"
    if row["chosen"] == row["rejected"]:
        return "chosen and rejected are identical (the pair carries no preference)"
    return None


def _chat_pair(tok: Any, prompt: list[dict], answer: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of one chat side: the completion is the assistant turn through its
    end-of-turn token."""
    from core.chat import render_chat

    ids, targets = render_chat(tok, [*prompt, *answer])
    first, last = min(targets), max(targets)  # one assistant turn (checked): its tokens are contiguous
    if targets != list(range(first, last + 1)):
        raise MalformedRow("the chat template interleaves non-assistant tokens with the answer")
    return ids[:first], ids[first : last + 1]


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
) -> tuple[list[Pair], list[str]]:
    """Every usable row as a `Pair`, and a description of each skipped one (raises `MalformedRow` on the first
    unless `skip_malformed`)."""
    from core.chat import ChatTemplateError

    pairs, skipped = [], []
    for i in range(len(records)) if rows is None else rows:
        row = records[i]
        problem = _row_problem(row, data_format)
        if problem is None:
            try:
                if data_format == "prompt_completion":
                    prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
                    chosen = tok(row["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                    rejected = tok(row["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                else:
                    prompt, chosen = _chat_pair(tok, row["prompt"], row["chosen"])
                    prompt_r, rejected = _chat_pair(tok, row["prompt"], row["rejected"])
                    if prompt_r != prompt:
                        raise MalformedRow("the prompt renders differently before chosen and rejected")
            except (ChatTemplateError, MalformedRow) as err:
                problem = str(err)
        if problem is None:
            if max_prompt_tokens is not None:
                prompt = prompt[-max_prompt_tokens:]
            if max_completion_tokens is not None:
                chosen, rejected = chosen[:max_completion_tokens], rejected[:max_completion_tokens]
            pair = Pair(i, tuple(prompt), tuple(chosen), tuple(rejected))
            if not prompt:
                problem = "empty prompt (a completion needs a token to follow)"
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
    return pairs, skipped


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
    return PairBatch(packed_batch(rows, targets, bucketed_width(longest, row_len)), mask)
