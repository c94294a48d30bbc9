"""Distillation step time: Temper's on-policy step vs TRL's DistillationTrainer, and Temper's offline top-k KD step
vs a plain PyTorch loop, each in one run.

    python bench/distill_step.py                        # both parts
    python bench/distill_step.py --parts offline --rounds 8

on-policy: the same student and teacher (HF directories built here, random; `--sizes` tiny: a 2 x 128
student, a 4 x 256 teacher; small: ~25M and ~85M; vocabulary 512, the arithmetic tokenizer), `--prompts`
reasoning-gym prompts a step, one completion each of at most `--max-tokens` tokens, reverse KL, one optimizer
update, float32 on 2 CPU cores.
Temper runs `posttrain.distill.onpolicy` (the JAX sampler in-process, and vLLM samplers on Ray with `--samplers
vllm`); its step time is its logged `time/step_s` (sampling, the teacher's pass, the update, weight sync). TRL
runs `trl.DistillationTrainer` with beta = 1 in its own virtual environment (`.venv-trl`, bench/grpo_step.py makes
it) with bf16=False and gradient checkpointing off. Temper's `gkd` side (`distill.on_policy_loss=gkd`,
`distill.loss=reverse`) computes what TRL does: reverse KL over the whole vocabulary at every completion token, the
teacher in the step; its `sampled` side the per-token estimator on the sampled token (a policy-gradient advantage,
as Qwen3 / Thinking Machines): the same sampling, teacher pass and update, a cheaper loss.
The two sides run one after the other (each needs both cores); first steps (compilation, warm-up) are left out.

offline: a student (hidden 512, 8 layers, vocabulary 32,768 untied: 58.7M parameters) on `--batch` rows
of `--seq` tokens, the second half of each row a target, with a stored top-`--k` per target; Temper's step is
`core.learner.Learner.update` on the distillation objective (`posttrain.distill.objective`), the peer the plain
loop of bench/torch_kd_step.py (HF model, AdamW, eager float32, the same loss). The sides alternate step by step
(`bench/interleaved.py`) on the same batches. Goals (issue 34): <= 0.5x TRL's on-policy step, <= 0.7x the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo_step import trl_python  # noqa: E402
from bench.interleaved import PeerStepper, interleave  # noqa: E402

# (student, teacher) shapes, vocabulary 512 and tied embeddings as in grpo_tiny.yml.
PAIRS = {
    "tiny": (
        dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
        dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32),
    ),
    "small": (  # ~25M student, ~85M teacher
        dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64),
        dict(hidden_size=768, intermediate_size=2560, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64),
    ),
}
OFFLINE = dict(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
)


def save_model(shape: dict, path: Path, tokenizer: str | None, seed: int) -> Path:
    from core.config_loader import load_config
    from core.hf.directory import save_hf
    from core.models import create_model, param_count
    from posttrain.config import PostTrainConfig

    cfg = load_config(
        ROOT / "recipes" / "configs" / "grpo_tiny.yml",
        [f"model.{k}={v}" for k, v in shape.items()],
        schema=PostTrainConfig,
    )
    model = create_model(cfg.model, seed=seed)
    print(f"{path.name}: {param_count(model) / 1e6:.1f}M parameters", flush=True)
    return save_hf(model, cfg.model, path, tokenizer_dir=tokenizer)


# ------------------------------------------------------------------ on-policy


def onpolicy(args, work: Path, tokenizer: str, size: str) -> dict:
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from core.sources import reasoning_gym_records
    from posttrain.config import PostTrainConfig
    from posttrain.distill.onpolicy import ON_POLICY_DISTILL
    from posttrain.fit import fit

    student = save_model(PAIRS[size][0], work / f"student_{size}", tokenizer, seed=0)
    teacher = save_model(PAIRS[size][1], work / f"teacher_{size}", tokenizer, seed=1)
    prompts = work / "prompts.jsonl"
    rows = reasoning_gym_records("basic_arithmetic", 256, seed=0)
    prompts.write_text(
        "".join(
            json.dumps({"question": r["question"], "answer": r["answer"], "prompt": f"{r['question']}\nAnswer:"}) + "\n"
            for r in rows
        )
    )
    out = work / "trl_distill.json"
    cmd = [
        str(trl_python()),
        str(ROOT / "bench" / "trl_distill_step.py"),
        "--student",
        str(student),
        "--teacher",
        str(teacher),
        "--prompts",
        str(prompts),
        "--steps",
        str(args.steps + 1),
        "--prompts-per-step",
        str(args.prompts),
        "--max-tokens",
        str(args.max_tokens),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    theirs = json.loads(out.read_text())["step_times"][1:]
    result = {"trl": {"step_s": statistics.mean(theirs), "median_step_s": statistics.median(theirs)}}
    sides = [(sampler, "sampled") for sampler in args.samplers] + [("jax", "gkd")] * ("gkd" in args.losses)
    for sampler, loss in sides:
        if loss == "sampled" and "sampled" not in args.losses:
            continue
        name = sampler if loss == "sampled" else f"{sampler}_gkd"
        run_dir = work / f"temper_{size}_{name}"
        cfg = load_config(
            ROOT / "recipes" / "configs" / "grpo_tiny.yml",
            [
                f"run.run_dir={run_dir}",
                f"checkpoint.init_from={student}",
                f"data.source={prompts}",
                f"data.tokenizer_dir={tokenizer}",
                "rl.prompt_template='{prompt}'",
                f"train.steps={args.steps + 1}",
                f"rl.batch.prompts_per_step={args.prompts}",
                "rl.batch.num_generations=1",
                f"rollout.max_tokens={args.max_tokens}",
                f"rollout.sampler={sampler}",
                "distill.regime=on_policy",
                f"distill.teacher={teacher}",
                f"distill.on_policy_loss={loss}",
                "distill.loss=reverse",
                "reward.functions=[]",
                "rl.accuracy_fn=null",
                "checkpoint.enabled=false",
                "checkpoint.export_hf=false",
                "data.eval_fraction=0.0",
                "optim.learning_rate=1.0e-5",
            ],
            schema=PostTrainConfig,
        )
        fit(cfg, ON_POLICY_DISTILL)
        steps = [r for r in read_metrics(run_dir) if "time/step_s" in r][1:]
        ours = [r["time/step_s"] for r in steps]
        means = {k: statistics.mean(r[k] for r in steps) for k in ("time/generate_s", "time/train_s", "time/sync_s")}
        result[name] = {
            "step_s": statistics.mean(ours),
            "median_step_s": statistics.median(ours),
            **{k.split("/")[1]: v for k, v in means.items()},
            "ratio": statistics.mean(ours) / result["trl"]["step_s"],
        }
        print(
            f"on-policy {size} [{name}]: Temper {result[name]['step_s']:.3f} s/step (generate "
            f"{result[name]['generate_s']:.3f}, train {result[name]['train_s']:.3f}, sync "
            f"{result[name]['sync_s']:.3f}) | TRL {result['trl']['step_s']:.3f} s/step | ratio "
            f"{result[name]['ratio']:.2f}",
            flush=True,
        )
    return result


# ------------------------------------------------------------------ offline


def offline_batches(args, work: Path) -> Path:
    """`args.rounds + 1` batches: random tokens, the second half of each row a target, a top-k per target
    (distinct ids, decreasing log-probs of a random distribution's head)."""
    import numpy as np

    rng = np.random.default_rng(0)
    n, b, length, k, vocab = args.rounds + 1, args.batch, args.seq, args.k, OFFLINE["vocab_size"]
    tokens = rng.integers(0, vocab, (n, b, length)).astype(np.int32)
    target = np.zeros((n, b, length), bool)
    target[:, :, length // 2 :] = True
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(n * b * length)]).reshape(n, b, length, k)
    logits = np.sort(rng.normal(0, 3, (n, b, length, k)), axis=-1)[..., ::-1]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True) * 1.25)  # the top-k holds 80% of the mass
    path = work / "kd_batches.npz"
    np.savez(
        path,
        tokens=tokens,
        attention=np.ones_like(tokens),
        target=target,
        topk_ids=ids.astype(np.int32),
        topk_logp=logp.astype(np.float32),
    )
    return path


def offline(args, work: Path) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from core.checkpoint_models import load_model_from
    from core.config import MeshConfig, OptimConfig
    from core.data import to_data_batch
    from core.learner import Learner
    from core.mesh import make_mesh
    from posttrain.distill.objective import DistillBatch, DistillModules, DistillSettings, distill_objective, trainable

    batches = offline_batches(args, work)
    data = np.load(batches)
    student = save_model(OFFLINE, work / "kd_student", None, seed=0)
    mesh = make_mesh(MeshConfig(), jax.devices())
    with jax.set_mesh(mesh):
        model = load_model_from(str(student), mesh)
    optim = OptimConfig(name="adamw", learning_rate=1e-4, schedule="constant", weight_decay=0.0, grad_clip_norm=None)
    learner = Learner(
        DistillModules(model),
        mesh,
        distill_objective(DistillSettings(), model.cfg),
        optim,
        total_updates=args.rounds + 1,
        trainable=trainable(nnx.Param),
    )

    def batch(i: int) -> DistillBatch:
        tokens = data["tokens"][i]
        b, length = tokens.shape
        rows = {
            "tokens": tokens,
            "positions": np.tile(np.arange(length, dtype=np.int32), (b, 1)),
            "segment_ids": np.ones_like(tokens),
            "loss_mask": data["target"][i].astype(np.int32),
            "example_ids": np.zeros_like(tokens),
        }
        packed = to_data_batch(rows, 1).batch
        index = np.asarray(packed.target_index)
        token_at = index - (np.arange(b)[:, None]) * length + 1  # the token each slot predicts
        take = lambda x: np.take_along_axis(x, token_at[..., None], axis=1)
        ones = np.ones(b, np.float32)
        return DistillBatch(packed, 0 * ones, ones, take(data["topk_ids"][i]), take(data["topk_logp"][i]))

    prepared = [batch(i) for i in range(args.rounds + 1)]

    def temper(i: int) -> float:
        import time

        start = time.perf_counter()
        update = learner.update(prepared[i])
        assert update.finite == 1.0 and update.grad_norm > 0
        return time.perf_counter() - start

    cmd = [
        str(trl_python()),
        str(ROOT / "bench" / "torch_kd_step.py"),
        "--student",
        str(student),
        "--batches",
        str(batches),
        "--serve",
    ]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    with PeerStepper(cmd, env) as torch_side:
        result = interleave(args.rounds, temper, lambda i: torch_side.step([i]))
    summary = result.summary()
    print(
        f"offline KD step: Temper {summary['a_median_s']:.3f} s | plain PyTorch {summary['b_median_s']:.3f} s | "
        f"median ratio {summary['median_ratio']:.2f}",
        flush=True,
    )
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["onpolicy", "offline"], choices=["onpolicy", "offline"])
    p.add_argument("--steps", type=int, default=6, help="on-policy: timed steps (after one warm-up step)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--samplers", nargs="+", default=["jax"], choices=["vllm", "jax"])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(PAIRS), help="on-policy models")
    p.add_argument(
        "--losses",
        nargs="+",
        default=["sampled", "gkd"],
        choices=["sampled", "gkd"],
        help="Temper's on-policy loss: the sampled-token advantage (per --samplers), and/or GKD (JAX sampler)",
    )
    p.add_argument("--rounds", type=int, default=6, help="offline: timed rounds (after one warm-up round)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "distill_step.json"))
    args = p.parse_args()

    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "onpolicy" in args.parts:
            texts = [r["text"] for r in reasoning_gym_records("basic_arithmetic", 500, 0)]
            tokenizer = str(build_tokenizer(texts, work / "tok", 512))
            results["onpolicy"] = {size: onpolicy(args, work, tokenizer, size) for size in args.sizes}
        if "offline" in args.parts:
            results["offline"] = offline(args, work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
