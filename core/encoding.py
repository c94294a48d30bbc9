"""Text -> token ids the way the model was pretrained and is served: the tokenizer's own special tokens, once.

    ids = encode_document(tok, "some text")     # pretraining text: [BOS] + text + EOS
    ids = encode_prompt(tok, "Question?")       # a prompt: [BOS] + text (training rows and samplers alike)
    ids = encode_completion(tok, " Answer.")    # what follows a prompt: text + EOS

Llama, Gemma and Mistral tokenizers add BOS in front of a text (`add_special_tokens=True`); Qwen's add nothing.
Whatever a tokenizer adds in front is added here, once: never a second time when the text already starts with it
(a text that spells out `<s>`), and never to a completion, which continues a prompt. What a tokenizer would add
behind a text (EOS, for a few) is left off a prompt, which the model continues, and written once after a document
or a completion. Chat conversations are rendered by their template, which writes its own BOS (`core.chat`: the
rendered text is tokenized with no special tokens added, as `apply_chat_template` does).
"""

from __future__ import annotations

from typing import Any

_PROBE = "probe"
_affixes_cache: dict[tuple, tuple[list[int], list[int]]] = {}


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(ids the tokenizer adds before a text, ids it adds after one), read off a probe (cached per tokenizer)."""
    key = (tokenizer.name_or_path, len(tokenizer), tokenizer.bos_token, tokenizer.eos_token, type(tokenizer).__name__)
    if key not in _affixes_cache:
        bare = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        full = tokenizer(_PROBE, add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
        _affixes_cache[key] = ([], []) if at is None else (list(full[:at]), list(full[at + len(bare) :]))
    return _affixes_cache[key]


def _body(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """[what the tokenizer puts in front] + the text's ids: what a model continues."""
    prefix, _ = special_affixes(tokenizer)
    body = _body(tokenizer, text)
    return body if prefix and body[: len(prefix)] == prefix else prefix + body


def _with_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids if eos is None or (ids and ids[-1] == eos) else [*ids, eos]


def encode_completion(tokenizer: Any, text: str) -> list[int]:
    """A continuation of a prompt: the text's ids and EOS (once), nothing in front."""
    return _with_eos(tokenizer, _body(tokenizer, text))


def encode_document(tokenizer: Any, text: str) -> list[int]:
    """A pretraining document: [what the tokenizer puts in front] + the text's ids + EOS (once)."""
    return _with_eos(tokenizer, encode_prompt(tokenizer, text))
