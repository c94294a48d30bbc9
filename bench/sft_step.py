"""SFT step time: Temper vs TRL's SFTTrainer vs a plain PyTorch loop, on the same model, rows and batch, one run.

    python bench/sft_step.py                        # tiny, T2 (56M) and 100M      (make bench-sft)
    python bench/sft_step.py --sizes T2 --steps 4
    python bench/sft_step.py --sizes T2 --steps 8 --interleave   # Temper and the plain loop in alternation

Every side trains the same HF model (random init, float32) on the same
prompt / completion rows (reasoning-gym text cut to 16-128 prompt and
16-127 completion tokens, so rows run 33-256 tokens), `batch` rows a step,
loss on the completion tokens only, AdamW. Temper's step is
`core.learner.Learner.update` on the SFT pipeline's batches (no packing: the
same rows per step as the peers), again padding-free (`data.padding_free`: the
same 8 sequences and gradient, first-fit into fewer rows) and with packing on
(more sequences per step: compare its tokens/s). Rows and completion-only targets are cut to
what the batch uses (`core.shapes.bucketed_width`, multiples of seq / 8), so a
batch's widths vary among a few values; each is compiled and run once before it
is timed, as a run does once per shape. TRL's SFTTrainer
(`bf16=False`; as TRL ships it, with gradient checkpointing, and again without
it: `trl_no_ckpt`, which like Temper keeps the activations) and the plain loop (HF model, AdamW, eager) run in the TRL
environment (`.venv-trl`, created on first use), so neither touches Temper's
dependencies. Step times exclude the first step (compilation, warm-up);
tokens/s counts real (non-padding) tokens. Goal (issue 16): Temper <= 0.5x
TRL's step time and <= 0.7x the plain loop's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo_step import trl_python  # noqa: E402
from bench.interleaved import PeerStepper, interleave  # noqa: E402

SIZES = {  # Llama-shaped, untied embeddings
    "tiny": dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
    "T2": dict(  # bench/train_throughput.py's T2: 56M parameters, 32k vocabulary
        hidden_size=512, intermediate_size=2048, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64
    ),
    "100M": dict(hidden_size=768, intermediate_size=2560, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64),
}
VOCAB = {"tiny": 512, "T2": 32000, "100M": 32000}


def write_results(out: str | Path, results: dict) -> None:
    """A benchmark's results as JSON at `out` (its folder made)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def hf_model(size: str, work: Path, tokenizer: str, seq: int) -> tuple[Path, int]:
    """An HF model directory for `size` (Llama-shaped, random init, with the tokenizer) and its parameter count."""
    from core.config import ModelConfig
    from core.hf.directory import save_hf
    from core.models import create_model, param_count

    cfg = ModelConfig(
        family="llama", vocab_size=VOCAB[size], tie_word_embeddings=False, max_position_embeddings=seq, **SIZES[size]
    )
    model = create_model(cfg, seed=0)
    return save_hf(model, cfg, work / f"hf_{size}", tokenizer_dir=tokenizer), param_count(model)


def text_pieces(tokenizer: str, lengths: list[list[int]]) -> list[list[str]]:
    """Consecutive pieces of reasoning-gym text of the given token lengths (one list of pieces per row)."""
    from transformers import AutoTokenizer

    from core.sources import reasoning_gym_records

    tok = AutoTokenizer.from_pretrained(tokenizer)
    text = " ".join(r["question"] for r in reasoning_gym_records("basic_arithmetic", 3000, seed=0))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out, at = [], 0
    for row in lengths:
        pieces = []
        for n in row:
            pieces.append(tok.decode(ids[at : at + n]))
            at += n
        out.append(pieces)
        at %= len(ids) - 400
    return out


def hf_learner(hf: Path, loss_fn, total_updates: int):
    """The HF model on one device, in a `core.learner.Learner` with `loss_fn` and AdamW (1e-4, constant, no weight
    decay): what every Temper side of the step benchmarks times."""
    import jax

    from core.config import OptimConfig
    from core.hf.directory import load_hf
    from core.learner import Learner
    from core.mesh import single_device_mesh

    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model, _ = load_hf(hf, mesh=mesh)
    optim = OptimConfig(name="adamw", learning_rate=1e-4, schedule="constant", weight_decay=0.0)
    return Learner(model, mesh, loss_fn, optim, total_updates=total_updates)


def compile_and_warm(learner, batch) -> None:
    """Compile the update for `batch`'s shape and, when that shape is new, run it once untimed: a run compiles
    each shape once, and a new executable's first run pays its buffers' first page faults."""
    known = learner.compiled_shapes
    learner.compile(batch)
    if learner.compiled_shapes > known:
        learner.update(batch)


def steps_for(size: str, steps: int | None) -> int:
    """Timed steps at `size`: `--steps` when given; else 16 at tiny, whose ~0.1-0.4 s steps swing by a third
    from step to step on this VM (4 steps leave the median to chance), and 4 above it."""
    return steps if steps is not None else (16 if size == "tiny" else 4)


def with_steps(args: argparse.Namespace, size: str) -> argparse.Namespace:
    """`args` with `steps` resolved for `size` (`steps_for`), for the side runners that read `args.steps`."""
    return argparse.Namespace(**{**vars(args), "steps": steps_for(size, args.steps)})


def peers_first(sides: list[str]) -> list[str]:
    """`sides` with the peers before Temper's: under the host malloc this process keeps what its Temper sides
    freed (~15 GiB at 100M), and a peer run after them (~9 GiB without checkpointing) would not fit in 24 GiB."""
    return sorted(sides, key=lambda n: n.startswith("temper"))


def build(size: str, work: Path, tokenizer: str, rows: int, seq: int) -> tuple[Path, Path, int]:
    """An HF model directory for `size` (with the tokenizer), the rows file, and the parameter count."""
    import numpy as np

    hf, params = hf_model(size, work, tokenizer, seq)
    data = work / "rows.jsonl"
    if not data.exists():
        rng = np.random.default_rng(0)
        lengths = [[int(rng.integers(16, 129)), int(rng.integers(16, 128))] for _ in range(rows)]
        out = [{"prompt": p, "completion": c} for p, c in text_pieces(tokenizer, lengths)]
        data.write_text("".join(json.dumps(r) + "\n" for r in out))
    return hf, data, params


def temper_side(hf: Path, data: Path, tokenizer: str, args, packing: bool, padding_free: bool):
    """A Temper learner on the HF model and the SFT pipeline's batches of `data` (rows in file order)."""
    from core.config import DataConfig
    from core.data import load_tokenizer, make_pipeline, tokenize_examples
    from core.losses import nll_loss
    from core.sources import load_records
    from posttrain.sft import PromptCompletionRows

    dcfg = DataConfig(
        source=str(data),
        format="prompt_completion",
        seq_len=args.seq,
        packing=packing,
        padding_free=padding_free,
        shuffle=False,
    )
    examples = tokenize_examples(load_records(dcfg), PromptCompletionRows(), load_tokenizer(tokenizer), dcfg)
    batches = iter(make_pipeline(examples, dcfg, args.batch))
    return hf_learner(hf, nll_loss, total_updates=args.steps + 1), batches


def timed_update(learner, batch) -> float:
    """Seconds of one `learner.update(batch)`, after compiling (and warming) its shape untimed."""
    compile_and_warm(learner, batch)
    start = time.perf_counter()
    learner.update(batch)
    return time.perf_counter() - start


def sequences_of(batch) -> list[int]:
    """The source rows (indices into the rows file) a pipeline batch holds."""
    import numpy as np

    return sorted({int(i) for i in np.asarray(batch.example_ids).ravel() if i >= 0})


def temper(hf: Path, data: Path, tokenizer: str, args, packing: bool, padding_free: bool = False) -> dict:
    import numpy as np

    learner, batches = temper_side(hf, data, tokenizer, args, packing, padding_free)
    times, tokens, sequences = [], [], []
    for _ in range(args.steps + 1):
        batch = next(batches)
        times.append(timed_update(learner, batch.batch))
        tokens.append(int((np.asarray(batch.batch.segment_ids) > 0).sum()))
        sequences.append(len(sequences_of(batch)))
    steady = times[1:]
    return {
        "first_step_s": times[0],
        "median_step_s": statistics.median(steady),
        "mean_step_s": statistics.mean(steady),
        "tokens_per_s": sum(tokens[1:]) / sum(steady),
        "sequences_per_step": statistics.mean(sequences[1:]),
    }


def interleaved_with_torch(hf: Path, data: Path, tokenizer: str, args, padding_free: bool) -> dict:
    """Temper's step (padded or padding-free rows) and the plain loop's, alternated round by round on the same
    rows (bench/interleaved.py): the ratio is the median of the per-round ratios."""
    learner, batches = temper_side(hf, data, tokenizer, args, packing=False, padding_free=padding_free)
    steps = [next(batches) for _ in range(args.steps + 1)]
    cmd = [*peer_cmd("torch", hf, data, args), "--serve"]
    # The plain loop inherits this environment, host malloc included (`make bench-sft`): it runs faster with it
    # (T2: ~3.9 s a step against ~5.5 s without, docs/benchmarks.md), unlike TRL's GRPO step (bench/grpo_step.py).
    with PeerStepper(cmd, dict(os.environ)) as torch_side:
        result = interleave(
            args.steps,
            lambda i: timed_update(learner, steps[i].batch),
            lambda i: torch_side.step(sequences_of(steps[i])),
        )
    return result.summary()


def peer_cmd(mode: str, hf: Path, data: Path, args) -> list[str]:
    """bench/torch_sft_step.py in the TRL environment, for `mode` on the HF model and the rows file."""
    cmd = [str(trl_python()), str(ROOT / "bench" / "torch_sft_step.py"), "--mode", mode, "--model", str(hf)]
    return [*cmd, "--data", str(data), "--seq", str(args.seq)]


def peer(mode: str, hf: Path, data: Path, args, work: Path) -> dict:
    out = work / f"{mode}_{hf.name}.json"
    cmd = [*peer_cmd(mode, hf, data, args), "--steps", str(args.steps), "--batch", str(args.batch)]
    subprocess.run([*cmd, "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def real_tokens(data: Path, tokenizer: str, batch: int, steps: int, seq: int) -> float:
    """Real tokens a step of the unpacked sides trains on (prompt + completion + EOS, at most `seq`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    rows = [json.loads(line) for line in data.read_text().splitlines()][batch : batch * (steps + 1)]
    n = [min(seq, len(tok(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"]) + 1) for r in rows]
    return sum(n) / steps


SIDES = ["temper", "temper_padding_free", "temper_packed", "trl", "trl_no_ckpt", "torch"]
PEERS = ["trl", "trl_no_ckpt", "torch"]
LAYOUTS = (("temper", "padded"), ("temper_padding_free", "padding_free"))  # Temper's unpacked sides


def sides_in_turn(hf: Path, data: Path, tokenizer: str, args, work: Path, params: int) -> dict:
    """Each side's steps in a block of their own (peers first), and the ratios of the medians."""
    row: dict = {"params": params}
    for name in peers_first(args.sides):
        if name.startswith("temper"):
            packing, padding_free = name == "temper_packed", name == "temper_padding_free"
            row[name] = temper(hf, data, tokenizer, args, packing, padding_free)
        else:
            row[name] = peer(name, hf, data, args, work)
        print(f"   {name:14s} {row[name]['median_step_s']:.3f} s/step", flush=True)
    per_step = real_tokens(data, tokenizer, args.batch, args.steps, args.seq)
    for name in set(PEERS) & set(row):
        row[name]["tokens_per_s"] = per_step / row[name]["median_step_s"]
    for side, layout in LAYOUTS:
        if not {side, "trl", "torch"} <= set(row):
            continue
        for peer_name in [n for n in PEERS if n in row]:
            row[f"ratio_{layout}_vs_{peer_name}"] = row[side]["median_step_s"] / row[peer_name]["median_step_s"]
        ratios = ", ".join(f"{n} {row[f'ratio_{layout}_vs_{n}']:.2f}x" for n in PEERS if n in row)
        print(f"   {layout}: Temper / {ratios}", flush=True)
    print("   tokens/s: " + ", ".join(f"{k} {row[k]['tokens_per_s']:,.0f}" for k in SIDES if k in row))
    return row


def interleaved_sides(hf: Path, data: Path, tokenizer: str, args, params: int) -> dict:
    """Each of Temper's unpacked sides in `args.sides` against the plain loop, step by step in alternation."""
    row: dict = {"params": params}
    for side, layout in LAYOUTS:
        if side not in args.sides:
            continue
        print(f"   {layout} rows and the plain loop in alternation (Temper s / torch s):", flush=True)
        r = interleaved_with_torch(hf, data, tokenizer, args, padding_free=side == "temper_padding_free")
        row[f"interleaved_{layout}_vs_torch"] = r
        print(
            f"   {layout}: Temper / torch {r['median_ratio']:.2f}x (median of {len(r['ratios'])} rounds; "
            f"medians {r['a_median_s']:.3f} s / {r['b_median_s']:.3f} s)",
            flush=True,
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "T2", "100M"], choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=None, help="timed steps a side (default: 16 at tiny, else 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", default="runs/bench_sft.json")
    p.add_argument("--sides", nargs="+", default=SIDES, choices=SIDES, help="the ratios need temper, trl and torch")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="time Temper's unpacked sides against the plain loop step by step in alternation (bench/interleaved.py)",
    )
    args = p.parse_args()

    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = str(
            build_tokenizer((r["text"] for r in reasoning_gym_records("basic_arithmetic", 2000, 0)), work / "tok")
        )
        most_steps = max(steps_for(size, args.steps) for size in args.sizes)  # one rows file serves every size
        for size in args.sizes:
            hf, data, params = build(size, work, tokenizer, args.batch * (most_steps + 2) * 4, args.seq)
            args_at = with_steps(args, size)
            print(f"== {size}: {params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq}", flush=True)
            if args.interleave:
                results[size] = interleaved_sides(hf, data, tokenizer, args_at, params)
            else:
                results[size] = sides_in_turn(hf, data, tokenizer, args_at, work, params)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
