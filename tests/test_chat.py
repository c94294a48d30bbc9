"""Chat templates -> assistant tokens, for templates without generation markers (Qwen2.5- and Llama-3-style,
built offline), checked against hand-built expectations and against transformers' own assistant mask."""

from __future__ import annotations

import pytest

from core.chat import ChatTemplateError, render_chat

QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

STYLES = {
    "qwen2.5": dict(
        template=QWEN25_TEMPLATE,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        close="<|im_end|>",
    ),
    "llama3": dict(
        template=LLAMA3_TEMPLATE,
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        close="<|eot_id|>",
    ),
}

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 10 + 7?"},
    {"role": "assistant", "content": "It is 17."},
]


def chat_tokenizer(tmp_path, style: str):
    """A byte-level BPE tokenizer trained offline, with the style's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant numbers helpful"] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=spec["specials"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], chat_template=spec["template"]
    )
    fast.save_pretrained(tmp_path / style)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tmp_path / style)


def target_runs(tokenizer, ids, targets):
    """The decoded text of each run of consecutive target positions."""
    runs, current = [], []
    for k in targets:
        if current and k != current[-1] + 1:
            runs.append(current)
            current = []
        current.append(k)
    if current:
        runs.append(current)
    return [tokenizer.decode([ids[k] for k in run], skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("style", sorted(STYLES))
def test_assistant_turns_and_their_end_of_turn_token_are_the_targets(tmp_path, style):
    tok = chat_tokenizer(tmp_path, style)
    ids, targets = render_chat(tok, CONVERSATION)
    close = STYLES[style]["close"]
    # hand-built: each assistant turn's content and its closing token, nothing of the system or user turns
    assert target_runs(tok, ids, targets) == [f"2 + 3 = 5.{close}", f"It is 17.{close}"]
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    rest = tok.decode([t for k, t in enumerate(ids) if k not in set(targets)], skip_special_tokens=False)
    assert "What is 2 + 3?" in rest and "You add numbers." in rest and "It is 17." not in rest


def test_templates_with_generation_markers_agree_with_transformers_mask(arithmetic_tokenizer):
    """Temper's own ChatML template has {% generation %} markers: transformers' assistant mask is then an
    independent reference for the prefix-by-prefix spans."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    ids, targets = render_chat(tok, CONVERSATION)
    ref = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"])
    assert targets == [k for k, m in enumerate(ref["assistant_masks"]) if m]


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tok = chat_tokenizer(tmp_path, "qwen2.5")
    # like Qwen3 dropping earlier reasoning: every assistant turn but the last one is shortened
    tok.chat_template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.role == 'assistant' and not loop.last %}{{- message.content[:3] }}"
        "{%- else %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(ChatTemplateError, match="message 2: the chat template does not render"):
        render_chat(tok, CONVERSATION)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        render_chat(tok, CONVERSATION)
