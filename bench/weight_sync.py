"""Trainer -> vLLM weight sync bandwidth for a ~0.5B-parameter model, relative to memcpy.

    python bench/weight_sync.py                       # qwen2.5-0.5b shape, float32, 256 MiB chunks
    python bench/weight_sync.py --preset tiny-qwen2 --chunk-mib 1

The trainer's parameters (random, float32) live in this JAX process; vLLM runs
in a Ray actor. A sync reads the shards this process's devices hold in chunks,
ships them through the Ray object store into the actor's receive buffers, where
each tensor is put together and laid out, and reloads the engine
(`rollout.weight_sync.sync_to_vllm`). GB/s is bytes / wall time of the whole
sync; memcpy GB/s is a warm `np.copyto` of 1 GiB measured in the same run.
The first sync allocates the receive buffers; the second reuses them.
Goal (issue 4): sync GB/s / memcpy GB/s >= 0.5.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.floors import copy_bandwidth  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_sync.json"))
    args = p.parse_args()

    from flax import nnx

    from core.config_loader import load_config
    from core.hf.directory import save_hf
    from core.models import create_model, param_count
    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer
    from rollout.config import RolloutConfig
    from rollout.ray import ensure_ray
    from rollout.vllm_actor import RemoteVLLMSampler
    from rollout.weight_sync import sync_to_vllm

    cfg = load_config(
        overrides=[f"model.preset={args.preset}", "model.dtype=float32", "model.param_dtype=float32"]
    ).model
    print(f"building {args.preset} ({cfg.num_layers} layers, hidden {cfg.hidden_size}) ...", flush=True)
    model = create_model(cfg, seed=0)
    params = nnx.state(model)
    ensure_ray(num_cpus=2)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(
            [r["text"] for r in reasoning_gym_records("basic_arithmetic", 200, 0)], Path(tmp) / "tok", 512
        )
        hf_dir = save_hf(model, cfg, Path(tmp) / "hf", tokenizer_dir=tok)
        print("starting vLLM ...", flush=True)
        sampler = RemoteVLLMSampler.start(
            str(hf_dir), RolloutConfig(max_model_len=256, kv_cache_gib=0.25, max_num_seqs=4, dtype="float32")
        )
        shutil.rmtree(hf_dir)
        try:
            mem = copy_bandwidth() / 1e9
            chunk = args.chunk_mib * 2**20
            first = sync_to_vllm(params, cfg, sampler, chunk)
            warm = sync_to_vllm(params, cfg, sampler, chunk)
        finally:
            sampler.shutdown()
    rows = {"first": first, "warm": warm}
    print(
        f"\n{args.preset}: {param_count(model) / 1e6:.0f}M parameters, {first.bytes / 2**30:.2f} GiB float32, "
        f"chunks of {args.chunk_mib} MiB; memcpy {mem:.2f} GB/s"
    )
    result = {"preset": args.preset, "params": param_count(model), "memcpy_gbps": mem}
    for name, s in rows.items():
        gbps = s.bytes / s.seconds / 1e9
        print(f"{name:>5} sync: {s.seconds:.2f} s, {gbps:.2f} GB/s = {gbps / mem:.2f} x memcpy ({s.chunks} chunks)")
        result[name] = {"seconds": s.seconds, "bytes": s.bytes, "gbps": gbps, "ratio_to_memcpy": gbps / mem}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
