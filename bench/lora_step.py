"""LoRA: the SFT step against TRL's SFTTrainer with PEFT and a plain PyTorch + PEFT loop, the GRPO step against full
GRPO, the memory LoRA saves, and the bytes and time of an adapters-only weight sync against a full one; one run.

    python bench/lora_step.py                              # tiny and 100M
    python bench/lora_step.py --sizes 100M --steps 4 --rank 16

Every side trains the same HF model (random init, float32, Llama-shaped) with rank-R adapters (alpha 2R, no
dropout) on the seven projections:

- SFT: the prompt / completion rows of bench/sft_step.py (`batch` rows a step, completion-only loss, no packing:
  the same rows per step on every side), AdamW at 1e-4. Temper: `core.learner.Learner.update` on a model with
  `model.lora` adapters; TRL: `SFTTrainer(peft_config=LoraConfig(...))`, bf16 off, with and without its default
  gradient checkpointing; the plain loop: `peft.get_peft_model` + AdamW on the adapters, eager. Peers run in the
  TRL environment (`.venv-trl`). Full-parameter Temper SFT on the same rows is timed beside them.
- GRPO: `MethodLearner(cfg, GRPO, ...).train` (the trainer's whole step: pi_old's pass, the clipped update) on one
  rollout batch (8 prompts x 8 completions, 64 + 128 tokens, advantages with variance), LoRA against full.
- Memory: XLA's memory analysis of the compiled SFT update (arguments: parameters and optimizer moments; temp),
  and the trainable, optimizer-state and checkpoint bytes, LoRA against full; the frozen base's bytes with QLoRA
  (int8, NF4: the same step on a quantized base, timed too).
- Sync: an in-process vLLM engine (CPU) taking the full model (`sync_to_vllm`) and the adapters alone
  (`sync_adapters_to_vllm`, LoRA enabled in the engine), bytes and seconds (`--no-sync` skips it).

Step times exclude the first step (compilation, warm-up): medians of the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo_step import trl_python  # noqa: E402
from bench.sft_step import (  # noqa: E402
    SIZES,
    build,
    compile_and_warm,
    steps_for,
    temper_side,
    with_steps,
    write_results,
)

MEMORY = re.compile(r"arguments ([\d.]+) GiB, outputs ([\d.]+) GiB, temp ([\d.]+) GiB")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_cfg(rank: int, quantize: str = "none"):
    from core.config import LoraConfig

    return LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS, quantize_base=quantize)


def learner_on(hf: Path, loss_fn, total_updates: int, rank: int, quantize: str = "none"):
    """The HF model on one device (with rank-`rank` adapters when `rank` > 0, on a `quantize`d base) in a
    `core.learner.Learner`, AdamW at 1e-4, constant, no weight decay."""
    import jax

    from core.config import OptimConfig
    from core.hf.directory import load_hf
    from core.learner import Learner
    from core.mesh import single_device_mesh
    from core.models.adapters import add_adapters

    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model, _ = load_hf(hf, mesh=mesh)
        if rank:
            model = add_adapters(model, lora_cfg(rank, quantize), mesh, seed=0)
    optim = OptimConfig(name="adamw", learning_rate=1e-4, schedule="constant", weight_decay=0.0)
    return Learner(model, mesh, loss_fn, optim, total_updates=total_updates)


def nbytes(tree) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def temper_sft(hf: Path, data: Path, tokenizer: str, args, rank: int, quantize: str = "none") -> dict:
    """Temper's SFT step on the pipeline's padded batches (full, LoRA or QLoRA), its memory analysis and state
    bytes."""
    import numpy as np

    from core.losses import nll_loss

    _, batches = temper_side(hf, data, tokenizer, args, packing=False, padding_free=False)
    learner = learner_on(hf, nll_loss, args.steps + 1, rank, quantize)
    times, tokens, memory = [], [], None
    for _ in range(args.steps + 1):
        batch = next(batches).batch
        compile_and_warm(learner, batch)
        if memory is None:
            memory = [float(x) for x in MEMORY.search(learner.last_compile or "").groups()]
        start = time.perf_counter()
        update = learner.update(batch)
        times.append(time.perf_counter() - start)
        tokens.append(int((np.asarray(batch.segment_ids) > 0).sum()))
        assert update.applied and update.grad_norm > 0
    steady = times[1:]
    # The forward pass alone (the loss, no gradient) on the same batches: the step's floor is about twice it, since
    # the backward pass through a frozen weight (the input's gradient) costs the matmuls of its forward.
    forward = []
    for _ in range(args.steps + 1):
        batch = next(batches).batch
        learner.evaluate(batch)  # compiled for this shape untimed
        start = time.perf_counter()
        learner.evaluate(batch)
        forward.append(time.perf_counter() - start)
    return {
        "median_step_s": statistics.median(steady),
        "median_forward_s": statistics.median(forward),
        "tokens_per_s": sum(tokens[1:]) / sum(steady),
        "xla_arguments_gib": memory[0],
        "xla_temp_gib": memory[2],
        "trainable_bytes": nbytes(learner.params),
        "optimizer_bytes": nbytes(learner.state.opt_state),
        "frozen_bytes": nbytes(learner.rest),
    }


def peer(mode: str, hf: Path, data: Path, args, work: Path) -> dict:
    """bench/torch_sft_step.py in the TRL environment with `--lora`."""
    out = work / f"{mode}_lora_{hf.name}.json"
    cmd = [str(trl_python()), str(ROOT / "bench" / "torch_sft_step.py"), "--mode", mode, "--model", str(hf)]
    cmd += ["--data", str(data), "--seq", str(args.seq), "--steps", str(args.steps), "--batch", str(args.batch)]
    subprocess.run([*cmd, "--lora", str(args.rank), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def grpo_step(hf: Path, args, rank: int) -> dict:
    """GRPO's `MethodLearner.train` on one rollout batch (8 prompts x 8 completions of 128 tokens after 64)."""
    import jax
    import numpy as np

    from core.config_loader import load_config
    from core.hf.directory import load_hf
    from core.mesh import single_device_mesh
    from core.method_learner import MethodLearner
    from core.models.adapters import add_adapters
    from posttrain.advantages import group_advantages
    from posttrain.config import PostTrainConfig
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.policy_gradient import rl_batch
    from rollout.sampler import Completion

    cfg = load_config(
        ROOT / "recipes" / "configs" / "grpo_tiny.yml",
        [
            "rollout.max_model_len=256",
            "rollout.max_tokens=128",
            "rl.batch.prompts_per_step=8",
            "rl.batch.num_generations=8",
            "optim.learning_rate=1.0e-4",
        ],
        schema=PostTrainConfig,
    )
    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model, model_cfg = load_hf(hf, mesh=mesh)
        if rank:
            model = add_adapters(model, lora_cfg(rank), mesh, seed=0)
    cfg = cfg.model_copy(update={"model": model.cfg, "train": cfg.train.model_copy(update={"steps": args.steps + 1})})
    learner = MethodLearner(cfg, GRPO, model, mesh)
    rng = np.random.default_rng(0)
    vocab = model_cfg.vocab_size
    times = []
    for _ in range(args.steps + 1):
        prompts = [[int(t) for t in rng.integers(3, vocab, 64)] for _ in range(8)]
        comps = [
            Completion(p, [int(t) for t in rng.integers(3, vocab, 128)], list(-rng.uniform(1, 6, 128)), "stop", "")
            for p in prompts
            for _ in range(8)
        ]
        adv = group_advantages(rng.normal(size=64), 8, "group_norm")
        batch = rl_batch(cfg, comps, adv, 256, 1)
        start = time.perf_counter()
        stats = learner.train(batch)
        times.append(time.perf_counter() - start)
        assert stats.metrics["grad_norm"] > 0
    return {"median_step_s": statistics.median(times[1:]), "first_step_s": times[0]}


def sync(hf: Path, tokenizer: str, work: Path, rank: int) -> dict:
    """Bytes and seconds of syncing the whole model and the adapters alone into an in-process vLLM engine (each
    its engine: the adapters' serves the base with LoRA enabled)."""
    import jax
    import numpy as np
    from flax import nnx

    from core.hf.directory import load_hf
    from core.mesh import single_device_mesh
    from core.models.adapters import add_adapters
    from rollout.config import RolloutConfig
    from rollout.vllm_sampler import VLLMSampler
    from rollout.weight_sync import sync_adapters_to_vllm, sync_to_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        base, cfg = load_hf(hf, mesh=mesh)
        policy = add_adapters(base, lora_cfg(rank), mesh, seed=0)
    for _, var in nnx.iter_graph(policy):  # trained-looking adapters (B non-zero)
        if isinstance(var, nnx.LoRAParam):
            var.set_value(jax.numpy.asarray(np.random.default_rng(1).normal(0, 0.01, var.shape), var.dtype))
    rollout = RolloutConfig(max_model_len=256, max_num_seqs=8, kv_cache_gib=0.5, dtype="float32")
    out = {}
    for name, adapter in (("full", None), ("adapters", lora_cfg(rank))):
        sampler = VLLMSampler(hf, rollout, seed=0, adapter=adapter)
        try:
            runs = []
            for version in range(1, 4):
                if adapter is None:
                    stats = sync_to_vllm(nnx.state(base), cfg, sampler, 256 * 2**20, version=version)
                else:
                    stats = sync_adapters_to_vllm(policy, sampler, version=version)
                runs.append(stats)
            out[name] = {"bytes": runs[-1].bytes, "seconds": statistics.median(r.seconds for r in runs[1:])}
        finally:
            sampler.shutdown()
    out["bytes_ratio"] = out["adapters"]["bytes"] / out["full"]["bytes"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "100M"], choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=None, help="timed steps a side (default: 16 at tiny, else 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--only-lora", action="store_true", help="the LoRA SFT step and its forward pass alone")
    p.add_argument("--peers", nargs="*", default=["trl", "trl_no_ckpt", "torch"])
    p.add_argument("--out", default="runs/bench_lora.json")
    args = p.parse_args()

    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts = (r["text"] for r in reasoning_gym_records("basic_arithmetic", 2000, 0))
        tokenizer = str(build_tokenizer(texts, work / "tok"))
        most = max(steps_for(size, args.steps) for size in args.sizes)
        for size in args.sizes:
            hf, data, params = build(size, work, tokenizer, args.batch * (most + 2) * 4, args.seq)
            at = with_steps(args, size)
            print(f"== {size}: {params / 1e6:.1f}M parameters, LoRA rank {args.rank}, batch {args.batch}", flush=True)
            row: dict = {"params": params}
            for mode in args.peers:  # peers first: they need the memory a Temper side would keep
                row[f"{mode}_lora"] = peer(mode, hf, data, at, work)
                print(f"   {mode} + PEFT      {row[f'{mode}_lora']['median_step_s']:.3f} s/step", flush=True)
            sides = (("temper_lora", args.rank, "none"), ("temper_full", 0, "none"))
            sides += tuple((f"temper_qlora_{q}", args.rank, q) for q in ("int8", "nf4"))
            for name, rank, quantize in sides:
                if args.only_lora and name != "temper_lora":
                    continue
                row[name] = temper_sft(hf, data, tokenizer, at, rank, quantize)
                print(f"   {name:16s} {row[name]['median_step_s']:.3f} s/step "
                      f"(forward alone {row[name]['median_forward_s']:.3f} s)", flush=True)  # fmt: skip
            if args.only_lora:
                results[size] = row
                continue
            lora, full = row["temper_lora"], row["temper_full"]
            for mode in args.peers:
                row[f"ratio_vs_{mode}_lora"] = lora["median_step_s"] / row[f"{mode}_lora"]["median_step_s"]
            row["memory"] = {
                "xla_arguments_lora_over_full": lora["xla_arguments_gib"] / full["xla_arguments_gib"],
                "xla_total_lora_over_full": (lora["xla_arguments_gib"] + lora["xla_temp_gib"])
                / (full["xla_arguments_gib"] + full["xla_temp_gib"]),
                "optimizer_bytes": [lora["optimizer_bytes"], full["optimizer_bytes"]],
                "checkpoint_bytes": [lora["trainable_bytes"] + lora["optimizer_bytes"], full["trainable_bytes"]
                                     + full["optimizer_bytes"]],
                "frozen_bytes": {n: row[f"temper_{n}"]["frozen_bytes"] for n in ("lora", "qlora_int8", "qlora_nf4")},
                "xla_arguments_gib": {n: row[f"temper_{n}"]["xla_arguments_gib"]
                                      for n in ("full", "lora", "qlora_int8", "qlora_nf4")},
            }  # fmt: skip
            print("   SFT step: LoRA / " + ", ".join(f"{m}+PEFT {row[f'ratio_vs_{m}_lora']:.2f}x" for m in args.peers))
            print(f"   memory: {json.dumps(row['memory'])}", flush=True)
            grpo = {name: grpo_step(hf, at, rank) for name, rank in (("lora", args.rank), ("full", 0))}
            grpo["lora_over_full"] = grpo["lora"]["median_step_s"] / grpo["full"]["median_step_s"]
            row["grpo"] = grpo
            print(f"   GRPO step: LoRA {grpo['lora']['median_step_s']:.3f} s, full {grpo['full']['median_step_s']:.3f}"
                  f" s ({grpo['lora_over_full']:.2f}x)", flush=True)  # fmt: skip
            if not args.no_sync:
                row["sync"] = sync(hf, tokenizer, work, args.rank)
                print(f"   sync: {json.dumps(row['sync'])}", flush=True)
            results[size] = row
    write_results(args.out, results)


if __name__ == "__main__":
    main()
