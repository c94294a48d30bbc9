"""Peak memory and time: chunked (vocabulary-tiled) vs naive per-token log-probs + entropy.

    python bench/logprobs_memory.py                 # vocab 151936, seq 1024, batch 4, hidden 1024
    python bench/logprobs_memory.py --vocab 32000   # smaller, faster

Each variant runs in its own process so peak RSS is its own. Two memory
figures per variant: XLA's compiled memory analysis (temp + output bytes:
what the computation allocates beyond its inputs) and the process's peak RSS
above its RSS once the inputs exist (this one also counts compilation). Time is the median of `--repeats` runs
after a warm-up.
Goal (issue 2): chunked forward+backward peak <= 0.25x naive at <= 1.3x the time.
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
    from core.kernels.logprobs import chunked_logprobs_and_entropy, naive_logprobs_and_entropy

    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    h = jax.random.normal(k1, (args.batch, args.seq, args.hidden), jnp.float32)
    w = jax.random.normal(k2, (args.hidden, args.vocab), jnp.float32) / args.hidden**0.5
    y = jax.random.randint(k3, (args.batch, args.seq), 0, args.vocab)
    if args.impl == "naive":
        fn = lambda h, w: naive_logprobs_and_entropy(h, w, y)
    else:
        fn = lambda h, w: chunked_logprobs_and_entropy(h, w, y, chunk_size=args.chunk)

    def objective(h, w):
        logp, ent = fn(h, w)
        return logp.sum() + 0.1 * ent.sum()

    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)) if args.grad else objective)
    jax.block_until_ready((h, w, y))
    rss_inputs = psutil.Process().memory_info().rss  # current RSS with the inputs resident
    compiled = step.lower(h, w).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(h, w))  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(h, w))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # includes compilation
    return {
        "impl": args.impl,
        "grad": args.grad,
        "xla_temp_plus_output_bytes": int(mem.temp_size_in_bytes + mem.output_size_in_bytes),
        "peak_rss_growth_bytes": int(peak - rss_inputs),
        "seconds": statistics.median(times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--impl", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--grad", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "logprobs_memory.json"))
    args = p.parse_args()

    if args.impl:  # child process: one variant
        print(json.dumps(run_variant(args)))
        return

    results = []
    shared = [f"--{k}={getattr(args, k)}" for k in ("vocab", "seq", "batch", "hidden", "chunk", "repeats")]
    for grad in (False, True):
        for impl in ("naive", "chunked"):
            cmd = [sys.executable, __file__, f"--impl={impl}", *shared] + (["--grad"] if grad else [])
            print(f"running {impl} {'forward+backward' if grad else 'forward'} ...", flush=True)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))

    gib = 2**30
    print(f"\nB={args.batch} T={args.seq} D={args.hidden} V={args.vocab} chunk={args.chunk}, float32, CPU")
    print(f"{'variant':<26}{'XLA temp+out GiB':>18}{'peak RSS GiB':>14}{'seconds':>10}")
    for r in results:
        name = f"{r['impl']} {'fwd+bwd' if r['grad'] else 'fwd'}"
        print(
            f"{name:<26}{r['xla_temp_plus_output_bytes'] / gib:>18.3f}"
            f"{r['peak_rss_growth_bytes'] / gib:>14.3f}{r['seconds']:>10.2f}"
        )
    for grad in (False, True):
        n, c = (next(r for r in results if r["impl"] == i and r["grad"] == grad) for i in ("naive", "chunked"))
        label = "fwd+bwd" if grad else "fwd"
        print(
            f"{label}: chunked/naive memory (XLA) "
            f"{c['xla_temp_plus_output_bytes'] / n['xla_temp_plus_output_bytes']:.3f}x, "
            f"(RSS) {c['peak_rss_growth_bytes'] / max(n['peak_rss_growth_bytes'], 1):.3f}x, "
            f"time {c['seconds'] / n['seconds']:.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
