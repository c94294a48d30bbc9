"""Training throughput of the core train step on this machine: tokens/s and model FLOP/s vs matmul peak.

    python bench/train_throughput.py                  # T1 and T2, scan on/off, remat on/off
    python bench/train_throughput.py --configs T2 --steps 10

Float32, sequence 256, batch 8, AdamW, the next-token loss (vocabulary-tiled
log-probs). Model FLOPs per token are 6N + attention (`core.metrics`); the
peak is a large float32 matmul measured in the same process. Goal (issue 3):
at T2, model FLOP/s >= 60% of the measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "T1": dict(
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    "T2": dict(
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
}


def measure(name: str, scan: bool, remat: bool, args) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from core.config import ModelConfig, OptimConfig
    from core.data import to_data_batch
    from core.losses import nll_loss
    from core.metrics import model_flops_per_token
    from core.models import create_model
    from core.optim import make_optimizer
    from core.train import init_train_state, jit_train_step, make_train_step, split_micro_batches, split_modules

    cfg = ModelConfig(
        family="llama",
        scan_layers=scan,
        remat_policy="full" if remat else "none",
        attention_impl=args.attention,
        vocab_chunk_size=args.vocab_chunk,
        **CONFIGS[name],
    )
    model = create_model(cfg, seed=0)
    graphdef, params, rest = split_modules(model, nnx.Param)
    tx = make_optimizer(OptimConfig(name="adamw", schedule="constant", learning_rate=1e-4), 100, params)
    state = init_train_state(params, tx, seed=0)
    step = jit_train_step(make_train_step(graphdef, nll_loss, tx), state)
    rng = np.random.RandomState(0)
    b, t = args.batch, args.seq
    rows = {
        "tokens": rng.randint(0, cfg.vocab_size, (b, t)).astype(np.int32),
        "segment_ids": np.ones((b, t), np.int32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "loss_mask": np.ones((b, t), np.int32),
        "example_ids": np.zeros((b, t), np.int32),
    }
    batch = split_micro_batches(to_data_batch(rows, 1).batch, 1)
    batch = jax.device_put(batch)
    start = time.perf_counter()
    state, m = step(state, batch, rest)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, m = step(state, batch, rest)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = model_flops_per_token(cfg, t) * b * t / seconds
    return {
        "config": name,
        "scan": scan,
        "remat": remat,
        "step_s": seconds,
        "compile_s": compile_s,
        "tokens_per_s": b * t / seconds,
        "model_tflops": flops / 1e12,
        "loss": float(m["loss"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["T1", "T2"], choices=sorted(CONFIGS))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--attention", default="xla", choices=["xla", "dot_product"])
    p.add_argument("--vocab-chunk", type=int, default=8192, help="model.vocab_chunk_size (>= vocab: full logits)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    args = p.parse_args()

    import jax

    from core.metrics import measure_matmul_peak

    peak = max(measure_matmul_peak(n=2048), measure_matmul_peak(n=4096, repeats=3))
    print(
        f"device: {jax.devices()[0].device_kind}, measured float32 matmul peak {peak / 1e9:.1f} GFLOP/s, "
        f"vocab chunk {args.vocab_chunk}, attention {args.attention}"
    )
    results = []
    print(
        f"{'config':<7}{'scan':<6}{'remat':<7}{'s/step':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'vs peak':>9}"
        f"{'compile s':>11}"
    )
    for name in args.configs:
        for scan in (True, False):
            for remat in (False, True):
                r = measure(name, scan, remat, args)
                r["fraction_of_peak"] = r["model_tflops"] * 1e12 / peak
                results.append(r)
                print(
                    f"{name:<7}{scan!s:<6}{remat!s:<7}{r['step_s']:>9.3f}{r['tokens_per_s']:>11,.0f}"
                    f"{r['model_tflops']:>9.4f}{100 * r['fraction_of_peak']:>8.1f}%{r['compile_s']:>11.1f}",
                    flush=True,
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"peak_flops": peak, "args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
