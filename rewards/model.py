"""A trained reward model as a reward function: a `...ForSequenceClassification` directory scores each completion.

    reward:
      functions:
        - {fn: reward_model, kwargs: {path: runs/reward_model_tiny/hf/reward_model, batch_size: 16}}

The model is what `recipes.reward_model` exports (or any one-label sequence-classification model `transformers`
reads without remote code). Each completion is scored as the reward model was trained on pairs
(`data.format=prompt_completion`): the prompt's ids as the model is given them, then the completion's ids and EOS
(`core.encoding`), re-encoded with the reward model's own tokenizer, so it need not share the policy's. The score is
the head's output at the sequence's last token, as `transformers` pools; sequences go `batch_size` at a time, right
padded (a causal model's last token sees no padding).

It runs where reward functions run: in the reward workers (`rewards.pool`), never in the trainer's step, under
its `timeout_s` (300 s unless set: `rewards.config.BUILTIN_TIMEOUT_S`); each worker loads the model once, on its
first call, and keeps it (one copy per worker: `reward.math_verify_num_procs` workers hold one each). `check` runs
at config load: a path that is not such a model, or whose head is not scalar, is refused there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_LOADED: dict[str, tuple[Any, Any]] = {}  # path -> (model, tokenizer), in this worker process


def check(kwargs: dict) -> None:
    """The kwargs name a local one-label sequence-classification model (raised as ValueError, naming what is wrong)."""
    unknown = sorted(set(kwargs) - {"path", "batch_size"})
    if unknown:
        raise ValueError(f"unknown kwargs {', '.join(unknown)}; the reward model takes path, batch_size")
    path = kwargs.get("path")
    if not isinstance(path, str):
        raise ValueError("kwargs.path: the reward model's directory (a ...ForSequenceClassification export) is needed")
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"kwargs.path={path!r}: no config.json there (not a Hugging Face model directory)")
    hf = json.loads(config.read_text())
    kinds = hf.get("architectures") or []
    if not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise ValueError(f"kwargs.path={path!r} is a {', '.join(kinds) or 'model'}, not a ...ForSequenceClassification")
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(
            f"kwargs.path={path!r}: its head has {labels} outputs; a reward model's is scalar (num_labels 1)"
        )


def _load(path: str) -> tuple[Any, Any]:
    if path not in _LOADED:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)  # no remote code
        _LOADED[path] = (model.eval(), AutoTokenizer.from_pretrained(path))
    return _LOADED[path]


def reward_model(
    prompts: Sequence[str], completions: Sequence[str], *, path: str, batch_size: int = 16, **_columns
) -> list[float]:
    """The reward model's score of each (prompt, completion)."""
    import torch

    from core.encoding import encode_completion, encode_prompt

    model, tokenizer = _load(path)
    sequences = [encode_prompt(tokenizer, p) + encode_completion(tokenizer, c) for p, c in zip(prompts, completions)]
    out: list[float] = []
    for lo in range(0, len(sequences), batch_size):
        part = sequences[lo : lo + batch_size]
        width = max(len(s) for s in part)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in part])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in part])
        with torch.no_grad():
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            scores = model.score(hidden)[:, :, 0]  # [B, T]: the head at every position
        last = torch.tensor([len(s) - 1 for s in part])
        out.extend(float(x) for x in scores[torch.arange(len(part)), last])
    return out
