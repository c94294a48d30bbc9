"""Peak memory and time of a distillation loss: the vocabulary-chunked divergence vs the naive one (both models'
full logits), forward + backward.

    python bench/kd_memory.py                      # vocab 151,936, 4 x 1024 tokens, student 896 wide, teacher 1536
    python bench/kd_memory.py --kind jsd --vocab 32000

The student is Qwen2.5-0.5B-wide (hidden 896), the teacher Qwen2.5-1.5B-wide (1536), both over Qwen's 151,936-token
vocabulary; the loss is the divergence summed over 4 x 1024 tokens, differentiated with respect to the student's
hidden states and output weight (`core.kernels.divergence`). Each variant runs in its own process. Memory: XLA's
compiled memory analysis (temp + output bytes: what the computation allocates beyond its inputs) and the process's
peak RSS growth once the inputs exist. Time: the median of `--repeats` runs after a warm-up. Goal (issue 34): the
chunked forward + backward at <= 0.25x the naive peak memory and <= 1.5x its time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_variant(args) -> dict:
    import jax
    import jax.numpy as jnp
    import psutil

    sys.path.insert(0, str(ROOT))
    from core.kernels.divergence import chunked_divergence, naive_divergence

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    n = args.batch * args.seq
    h_s = jax.random.normal(ks[0], (n, args.student), jnp.float32)
    w_s = jax.random.normal(ks[1], (args.student, args.vocab), jnp.float32) / args.student**0.5
    h_t = jax.random.normal(ks[2], (n, args.teacher), jnp.float32)
    w_t = jax.random.normal(ks[3], (args.teacher, args.vocab), jnp.float32) / args.teacher**0.5
    if args.impl == "naive":
        fn = lambda hs, ws: naive_divergence(hs, ws, h_t, w_t, args.kind, args.temperature)
    else:
        fn = lambda hs, ws: chunked_divergence(hs, ws, h_t, w_t, args.kind, args.temperature, chunk_size=args.chunk)
    step = jax.jit(jax.value_and_grad(lambda hs, ws: fn(hs, ws).sum(), argnums=(0, 1)))
    jax.block_until_ready((h_s, w_s, h_t, w_t))
    rss_inputs = psutil.Process().memory_info().rss
    compiled = step.lower(h_s, w_s).compile()
    mem = compiled.memory_analysis()
    if mem is None:
        raise SystemExit("this JAX backend gives no memory analysis for a compiled step")
    value, _ = jax.block_until_ready(compiled(h_s, w_s))  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(h_s, w_s))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "impl": args.impl,
        "loss": float(value),
        "xla_temp_plus_output_bytes": int(mem.temp_size_in_bytes + mem.output_size_in_bytes),
        "peak_rss_growth_bytes": int(peak - rss_inputs),
        "seconds": statistics.median(times),
        "backend": jax.default_backend(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--student", type=int, default=896, help="the student's hidden size")
    p.add_argument("--teacher", type=int, default=1536, help="the teacher's hidden size")
    p.add_argument("--kind", default="forward", choices=["forward", "reverse", "jsd"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--impl", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kd_memory.json"))
    args = p.parse_args()

    if args.impl:  # child process: one variant
        print(json.dumps(run_variant(args)))
        return

    shared = [
        f"--{k}={getattr(args, k)}"
        for k in ("vocab", "seq", "batch", "student", "teacher", "kind", "temperature", "chunk", "repeats")
    ]
    results = []
    for impl in ("naive", "chunked"):
        print(f"running {impl} forward+backward ...", flush=True)
        out = subprocess.run([sys.executable, __file__, f"--impl={impl}", *shared], check=True, capture_output=True)
        results.append(json.loads(out.stdout.decode().strip().splitlines()[-1]))
    gib = 2**30
    print(
        f"\n{args.kind} KL, N={args.batch}x{args.seq} tokens, V={args.vocab}, student {args.student} wide, teacher "
        f"{args.teacher} wide, chunk {args.chunk}, float32, {results[0]['backend']}"
    )
    print(f"{'variant':<10}{'XLA temp+out GiB':>18}{'peak RSS GiB':>14}{'seconds':>10}{'loss':>16}")
    for r in results:
        print(
            f"{r['impl']:<10}{r['xla_temp_plus_output_bytes'] / gib:>18.3f}{r['peak_rss_growth_bytes'] / gib:>14.3f}"
            f"{r['seconds']:>10.2f}{r['loss']:>16.6g}"
        )
    naive, chunked = results
    print(
        f"chunked / naive: memory {chunked['xla_temp_plus_output_bytes'] / naive['xla_temp_plus_output_bytes']:.3f}x "
        f"(XLA), {chunked['peak_rss_growth_bytes'] / max(naive['peak_rss_growth_bytes'], 1):.3f}x (RSS); "
        f"time {chunked['seconds'] / naive['seconds']:.2f}x"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
