"""Generate from a Hugging Face directory or a Temper run, with the JAX sampler or vLLM.

    python -m recipes.decode runs/pretrain_tiny --prompt "Calculate 2 + 3." --max-tokens 16
    python -m recipes.decode runs/pretrain_tiny/hf --sampler vllm --prompt "Calculate 7 * 6." --temperature 0.8 --n 4
    python -m recipes.decode MODEL_DIR --chat --prompt "What is 12 + 30?"     # apply the chat template

MODEL_DIR is a Hugging Face directory (config.json + safetensors) or a Temper
run directory with `checkpoints/` (the latest step; vLLM then serves an HF
export written to a temporary directory). Prints each completion and tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from rollout.sampler import SamplingParams


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.decode", description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--sampler", choices=["jax", "vllm"], default="jax")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's, or the run's tokenizer/)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings, at most 4096")
    return p.parse_args(argv)


def _hf_dir_and_tokenizer(model_dir: Path, tokenizer: str | None, tmp: str):
    """An HF directory to serve and the tokenizer to use, exporting a Temper checkpoint if needed."""
    from core.checkpoint_models import load_checkpoint_model
    from core.hf.directory import save_hf

    if (model_dir / "config.json").exists():
        return model_dir, tokenizer or str(model_dir), None
    model, model_cfg, saved = load_checkpoint_model(model_dir)
    tok = tokenizer or saved.get("data", {}).get("tokenizer_dir") or str(model_dir / "tokenizer")
    out = save_hf(model, model_cfg, Path(tmp) / "hf", tokenizer_dir=tok)
    return out, tok, model


def main(argv: list[str]) -> int:
    args = parse(argv)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
    )
    prompts = [[{"role": "user", "content": p}] for p in args.prompt] if args.chat else args.prompt
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, tokenizer, model = _hf_dir_and_tokenizer(Path(args.model_dir), args.tokenizer, tmp)
        if args.chat:  # a reply ends where the template ends a turn, not only on EOS
            from core.chat_template import turn_stop_ids
            from core.data import load_tokenizer

            params = dataclasses.replace(params, stop_token_ids=turn_stop_ids(load_tokenizer(tokenizer)))
        max_len = args.max_model_len or min(
            4096, json.loads((Path(hf_dir) / "config.json").read_text()).get("max_position_embeddings", 4096)
        )
        if args.sampler == "jax":
            from core.hf.directory import load_hf
            from rollout.jax_sampler import JaxSampler

            if model is None:
                model, _ = load_hf(hf_dir)
            sampler: JaxSampler | VLLMSampler = JaxSampler(model, tokenizer, max_model_len=max_len)
        else:
            from rollout.config import RolloutConfig
            from rollout.vllm_sampler import VLLMSampler

            if args.tokenizer:
                raise SystemExit("--tokenizer is not used with --sampler vllm: vLLM reads the model directory's")
            sampler = VLLMSampler(hf_dir, RolloutConfig(max_model_len=max_len, dtype="float32"))
        sampler.generate(prompts, params)  # warm-up (compilation) outside the timing
        start = time.perf_counter()
        completions = sampler.generate(prompts, params)
        seconds = time.perf_counter() - start
        sampler.stop()
    for i, c in enumerate(completions):
        print(f"[{i // args.n}.{i % args.n}] ({c.finish_reason}, {len(c.token_ids)} tokens) {c.text!r}")
    n_tokens = sum(len(c.token_ids) for c in completions)
    print(f"{n_tokens} tokens in {seconds:.2f}s: {n_tokens / seconds:,.1f} tokens/s ({args.sampler} sampler)")
    return 0


if __name__ == "__main__":
    from core.cli import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
