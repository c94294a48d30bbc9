"""An offline byte-level BPE tokenizer (digits split one by one), trained with the `tokenizers` library.

The embedded default has no hub access, so it trains its own tokenizer and
saves an ordinary Hugging Face tokenizer directory (tokenizer.json,
tokenizer_config.json with a ChatML chat template, special tokens) that
`transformers.AutoTokenizer` and vLLM load.

    python -m core.tokenizer OUT_DIR --vocab-size 512 --corpus corpus.txt
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: pad=0, bos=1, eos=2, im_start=3, im_end=4.
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML, as Qwen uses, with tool calling in Qwen2.5's (Hermes) convention, which vLLM's `hermes` tool parser
# reads: the tools' JSON schemas in the system turn between <tools> tags, each call the assistant makes as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> after its text, each tool result a `tool` turn.
# `{% generation %}` marks assistant tokens so that `apply_chat_template(..., return_assistant_tokens_mask=True)`
# can mask prompts in SFT.
CHAT_TEMPLATE = (
    "{% set offset = 0 %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n' }}{% set offset = 1 %}"
    "{% endif %}"
    "{{ '<tools>' }}{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages[offset:] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def open_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer saved in directory `path`, as `AutoTokenizer` builds it. A tokenizer directory
    without a model (no `config.json`) that names the plain fast class (`PreTrainedTokenizerFast`, `TokenizersBackend`
    in transformers 5: Temper's own tokenizers) is built directly: `AutoTokenizer` would build the same object
    after importing torch and transformers' model registry (~3 s of a process's start). Beside a model's
    `config.json`, `AutoTokenizer` may build another class than the one named (transformers 5 rebuilds a qwen2,
    phi3 or deepseek_v3 model's tokenizer as the family's own), so that case goes through it, as vLLM does."""
    import json

    path = Path(path)
    config = path / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in ("PreTrainedTokenizerFast", "TokenizersBackend") and not (path / "config.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_tokenizer(corpus: Iterable[str], out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train byte-level BPE on `corpus` and save a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} special tokens"
        )
    tok = Tokenizer(models.BPE())
    # Digits one by one (as Qwen2 and DeepSeek do): numbers stay arithmetic-friendly, never "1994" as one token.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1_000_000,
    )
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def tokenizer_for_run(
    tokenizer_dir: str | None,
    texts: Iterable[str],
    run_dir: str | Path,
    vocab_size: int,
    init_from: str | None = None,
) -> str:
    """The run's tokenizer directory: `tokenizer_dir` if set (a Hub id is resolved, `core.hf.hub`); else the initial
    checkpoint's, when it is a Hugging Face directory with a tokenizer (or a Temper run that recorded one); else a
    BPE tokenizer trained on `texts` into `run_dir/tokenizer` (reused on resume)."""
    from core.hf.hub import resolve_model

    if tokenizer_dir is not None:
        return str(resolve_model(tokenizer_dir, "data.tokenizer_dir"))
    if init_from is not None:
        found = checkpoint_tokenizer(init_from)
        if found is not None:
            return found
    out = Path(run_dir) / "tokenizer"
    if not (out / "tokenizer.json").exists():
        build_tokenizer(texts, out, vocab_size=vocab_size)
        print(f"trained a {vocab_size}-token BPE tokenizer -> {out}")
    return str(out)


def run_tokenizer(cfg: Any, texts: Callable[[], Iterable[str]]) -> str:
    """Every run's tokenizer (offline and on-policy alike, `tokenizer_for_run`'s order: `data.tokenizer_dir`, the
    initial checkpoint's, else one trained on `texts()` into the run directory); in a process group the first
    process trains a missing one and the others read it."""
    from core.distributed import primary_first

    return primary_first(
        lambda: tokenizer_for_run(
            cfg.data.tokenizer_dir, texts(), cfg.run.run_dir, cfg.model.vocab_size, cfg.checkpoint.init_from
        ),
        "the run's tokenizer",
    )


def main() -> None:
    p = argparse.ArgumentParser(description="Train an offline byte-level BPE tokenizer.")
    p.add_argument("out_dir")
    p.add_argument("--corpus", required=True, help="text file, one document per line")
    p.add_argument("--vocab-size", type=int, default=512)
    args = p.parse_args()
    lines = Path(args.corpus).read_text().splitlines()
    print(build_tokenizer(lines, args.out_dir, args.vocab_size))


if __name__ == "__main__":
    main()


def checkpoint_tokenizer(init_from: str) -> str | None:
    """The tokenizer that came with a checkpoint: an HF directory's own (or a Hub id's), a Temper run's
    `tokenizer/` or the `data.tokenizer_dir` its saved config names; None when there is none."""
    from core.hf.hub import resolve_model

    path = resolve_model(init_from, "checkpoint.init_from")
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        return str(path)
    if (path / "adapter_config.json").exists():  # a PEFT adapter without a tokenizer of its own: its base's
        import json

        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        return checkpoint_tokenizer(base) if base else None
    if (path / "tokenizer" / "tokenizer.json").exists():
        return str(path / "tokenizer")
    saved = path / "config.yaml"
    if saved.exists():
        import yaml

        named = (yaml.safe_load(saved.read_text()) or {}).get("data", {}).get("tokenizer_dir")
        if named and Path(named).exists():
            return str(named)
    return None


def check_vocab(vocab_size: int, tokenizer_dir: str) -> None:
    """The model's embedding must cover every token id of the tokenizer (a larger, padded embedding is fine)."""
    from core.config_loader import ConfigError

    n = len(open_tokenizer(tokenizer_dir))
    if n > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer in {tokenizer_dir} ({n} tokens)"
        )
