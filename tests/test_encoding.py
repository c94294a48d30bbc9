"""BOS as the tokenizer adds it, once, in training rows and in sampling alike (a Llama-style tokenizer puts BOS in
front of a text; a Qwen-style one adds nothing)."""

from __future__ import annotations

import pytest

from core.data import TextRows
from core.encoding import encode_completion, encode_document, encode_prompt, special_affixes
from tests.chat_families import chat_tokenizer

TEXT = "What is 2 + 3?"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Llama 3's special tokens and shipped template; BOS added in front of a text, as Llama's tokenizer does."""
    return chat_tokenizer(tmp_path_factory.mktemp("llama"), "llama3")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("qwen"), "qwen2_5")


def test_what_a_tokenizer_adds_is_read_off_it(llama, qwen):
    bos = llama.convert_tokens_to_ids("<|begin_of_text|>")
    assert llama(TEXT)["input_ids"][0] == bos  # the fixture really adds BOS, as Llama's tokenizer does
    assert special_affixes(llama) == ([bos], [])
    assert special_affixes(qwen) == ([], [])


def test_prompts_documents_and_completions_get_bos_once(llama, qwen):
    bos, eos = llama.bos_token_id, llama.eos_token_id
    body = llama(TEXT, add_special_tokens=False)["input_ids"]
    assert encode_prompt(llama, TEXT) == [bos, *body]
    assert encode_prompt(llama, "<|begin_of_text|>" + TEXT) == [bos, *body]  # spelt out already: not twice
    assert encode_document(llama, TEXT) == [bos, *body, eos]
    assert encode_completion(llama, " 5") == [*llama(" 5", add_special_tokens=False)["input_ids"], eos]
    q = qwen(TEXT, add_special_tokens=False)["input_ids"]
    assert encode_prompt(qwen, TEXT) == q and encode_document(qwen, TEXT) == [*q, qwen.eos_token_id]


def test_training_rows_and_the_sampler_agree_on_bos(llama):
    """Text, prompt / completion and chat rows, the preference pairs and the samplers' prompts: one BOS each, where
    the model was pretrained and is served with it (the chat template writes its own BOS; nothing adds another)."""
    from core.chat import render_chat
    from posttrain.dpo.pairs import tokenize_pairs
    from posttrain.sft import ChatRows, PromptCompletionRows
    from rollout.sampler import encode_prompts

    bos = llama.bos_token_id
    text_ids, _ = TextRows().tokenize({"text": TEXT}, llama)
    pc_ids, targets = PromptCompletionRows().tokenize({"prompt": TEXT, "completion": " 5"}, llama)
    chat = [{"role": "user", "content": TEXT}, {"role": "assistant", "content": "5"}]
    chat_ids, _ = ChatRows().tokenize({"messages": chat}, llama)
    (pair,), _, _ = tokenize_pairs(
        [{"prompt": TEXT, "chosen": " 5", "rejected": " 6"}], llama, data_format="prompt_completion", seq_len=64
    )
    sampled = encode_prompts(llama, [TEXT, chat[:1]])
    for ids in (text_ids, pc_ids, chat_ids, list(pair.prompt), *sampled):
        assert ids[0] == bos and ids.count(bos) == 1, ids
    assert pc_ids[: len(sampled[0])] == sampled[0]  # training's prompt is what the sampler gives the model
    assert chat_ids == render_chat(llama, chat)[0]
    assert min(targets) == len(sampled[0])  # the completion's targets start right after that prompt
