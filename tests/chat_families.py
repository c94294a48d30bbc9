"""The chat templates model families ship, with small offline tokenizers that carry each family's own special tokens.

The templates are read from TRL's package (`trl/chat_templates/*.jinja`: the originals, as the model repositories
carry them; `trl` is a dev dependency for this only). `chat_tokenizer(out, name)` trains a byte-level BPE tokenizer
offline, adds the family's special and added tokens, BOS / EOS and the template, and saves it to `out`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SHIPPED = Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "chat_templates"

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
DEEPSEEK = dict(
    adds_bos=True,
    specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
    added=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    header="<｜Assistant｜>",
    closers=("<｜end▁of▁sentence｜>",),
)
COHERE = dict(
    specials=[
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        "<|START_OF_TURN_TOKEN|>",
        "<|USER_TOKEN|>",
        "<|CHATBOT_TOKEN|>",
        "<|SYSTEM_TOKEN|>",
    ],
    bos="<BOS_TOKEN>",
    eos="<|END_OF_TURN_TOKEN|>",
    header="<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    closers=("<|END_OF_TURN_TOKEN|>",),
)
PHI3 = dict(
    specials=["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    bos="<s>",
    eos="<|endoftext|>",
    header="<|assistant|>",
    closers=("<|end|>",),
)
NEMOTRON = dict(
    specials=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
    added=["<think>", "</think>"],
    eos="<|im_end|>",
    header="<|im_start|>assistant",
    closers=("<|im_end|>",),
)
GEMMA = dict(
    adds_bos=True,
    specials=["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"],
    bos="<bos>",
    eos="<eos>",
    header="<start_of_turn>model",
    closers=("<end_of_turn>",),
)

# template file -> the family's tokens: special (never split, may close a turn), added (never split), BOS / EOS,
# whether the tokenizer puts BOS in front of a text (Llama, Gemma, DeepSeek do), how an assistant turn's header
# starts, which tokens may close an assistant turn.
FAMILIES = {
    "qwen2_5": dict(specials=QWEN_SPECIALS, eos="<|im_end|>", header="<|im_start|>assistant", closers=("<|im_end|>",)),
    "qwen3": dict(
        specials=QWEN_SPECIALS,
        added=["<think>", "</think>"],
        eos="<|im_end|>",
        header="<|im_start|>assistant",
        closers=("<|im_end|>",),
    ),
    "qwen3_instruct_2507": dict(
        specials=QWEN_SPECIALS, eos="<|im_end|>", header="<|im_start|>assistant", closers=("<|im_end|>",)
    ),
    **{
        name: dict(
            specials=QWEN_SPECIALS,
            added=["<think>", "</think>"],
            eos="<|im_end|>",
            header="<|im_start|>assistant",
            closers=("<|im_end|>",),
        )
        for name in ("qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "qwen3_8")
    },
    **{
        name: dict(
            adds_bos=True,
            specials=LLAMA_SPECIALS,
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            header="<|start_header_id|>assistant",
            closers=("<|eot_id|>",),
        )
        for name in ("llama3", "llama3_1", "llama3_2")
    },
    "deepseekv3": DEEPSEEK,
    "deepseek_r1_distill": DEEPSEEK,
    "gptoss": dict(
        specials=[
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|return|>",
            "<|call|>",
            "<|constrain|>",
        ],
        bos="<|startoftext|>",
        eos="<|return|>",
        header="<|start|>assistant",
        closers=("<|end|>", "<|return|>"),
    ),
    "phi3": PHI3,
    "phi3_5": PHI3,
    "nemotron_3_nano": NEMOTRON,
    "nemotron_3_super": NEMOTRON,
    "nemotron_3_ultra": NEMOTRON,
    "nemotron_3_5_lightning": NEMOTRON,
    "gemma": GEMMA,
    "gemma3": GEMMA,
    "lfm2": dict(
        specials=["<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos="<|startoftext|>",
        eos="<|im_end|>",
        header="<|im_start|>assistant",
        closers=("<|im_end|>",),
    ),
    "cohere": COHERE,
    # Command R7B / A (Cohere2): the reply between START_RESPONSE and END_RESPONSE, then END_OF_TURN_TOKEN, the token
    # its generation stops on: the turn's targets end with both
    "cohere2": {
        **COHERE,
        "specials": [*COHERE["specials"], "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
        "closers": ("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",),
    },
    # GLM closes a turn with the next turn's role token and the last one with nothing at all
    "glm4moe": dict(
        specials=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"],
        added=["<think>", "</think>"],
        eos="<|endoftext|>",
        header="<|assistant|>",
        closers=("<|user|>", ""),
    ),
}


def chat_tokenizer(
    out: Path, name: str, template: str | None = None, corpus: list[str] | None = None, spec: dict | None = None
):
    """The family's tokenizer (`spec`: another family's tokens) with `template` (default: the shipped one), saved to
    `out` and loaded back."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    spec = spec or FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = corpus or ["You add numbers. What is 2 + 3? And 10 + 7? It is 17. system user assistant model"] * 10
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in spec.get("added", [])])
    bos, eos = spec.get("bos"), spec["eos"]
    if spec.get("adds_bos"):  # as the family's tokenizer does with add_special_tokens=True
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        additional_special_tokens=[s for s in spec["specials"] if s not in (bos, eos)],
        chat_template=template or (SHIPPED / f"{name}.jinja").read_text(),
    )
    fast.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)
