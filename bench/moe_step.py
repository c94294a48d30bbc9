"""The mixture-of-experts train step: Temper vs transformers' own Qwen3-MoE in a plain PyTorch loop, and the grouped
matmuls side by side.

    .venv/bin/python bench/moe_step.py                      # ~100M total / ~25M active, 8 x 256 tokens, 6 steps
    .venv/bin/python bench/moe_step.py --steps 4 --batch 4

One Qwen3-MoE model (random weights, saved by transformers): 8 layers, hidden 512, 16 experts of width 448, top-2
(renormalised), vocabulary 8192, untied: 102.8M parameters, 25.8M active a token. Both sides train it on the
same rows of random tokens (every token a target, no padding), float32, next-token loss plus the load-balancing
loss at transformers' default weight (0.001; `output_router_logits=True` on the torch side), AdamW (lr 1e-4,
no weight decay), one update a step. Temper: `core.learner.Learner` with the pretraining loss, on one device (the
experts as `--kernel` says; `auto`, the default, picks the tiled form on CPU). torch: the model from `from_pretrained`,
eager, forward, backward, `torch.optim.AdamW` step. The sides alternate step by step in one process (each idle
while the other runs), after an untimed warm-up step each (Temper's compiles: its time is printed); medians are
reported, beside the step's floor on this machine (`bench/floors.py`, measured in the same process): its matmul
FLOPs (6 x the parameters a token is multiplied by, attention included) at the float32 matmul peak, plus AdamW's
bytes (7 x 4 bytes a parameter) at the read bandwidth. Goals (issue 54): Temper <= 0.5x the torch loop and <= 1.5x
the floor. Temper's goodput over its own steps and the compilations in its timed steps are printed
(`bench/timed_steps.py`).

Then the experts alone (one layer's 8 x 256 tokens, forward and backward): the dropless forms (rounds of capacity
buffers, the tiled grouped matmul, `ragged_dot`), the capacity-based form at capacity factors 1.0 and 1.25 (a fixed
[E, C, D] buffer an expert; the share of assignments it drops on these random routes is printed), and the dense
reference (every expert on every token), each beside its active FLOPs' time at the matmul peak (goal: >= 50% of
it). `--experts-only` runs this part alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,  # no dense layer uses it
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=448,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)


def build(work: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SHAPE, dtype="float32"))
    model.save_pretrained(work / "hf")
    return work / "hf"


def counts(hf: Path) -> tuple[int, int]:
    """(all parameters, parameters active a token) of the saved model."""
    from core.hf.directory import load_hf
    from core.models import param_count

    model, cfg = load_hf(hf)
    total = param_count(model)
    moe = cfg.moe
    assert moe is not None
    per_expert = 3 * cfg.hidden_size * moe.intermediate_size
    idle = cfg.num_layers * (moe.num_experts - moe.experts_per_token) * per_expert
    return total, total - idle


def rows(batch: int, seq: int, step: int):
    import numpy as np

    rng = np.random.default_rng(step)
    tokens = rng.integers(0, SHAPE["vocab_size"], (batch, seq)).astype(np.int32)
    return tokens


def batch_of(tokens):
    """The pretraining batch of [B, T] tokens: one sequence a row, every token a target."""
    import numpy as np

    from core.data import to_data_batch

    b, t = tokens.shape
    data = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        "segment_ids": np.ones((b, t), np.int32),
        "loss_mask": np.ones((b, t), np.int32),
        "example_ids": np.zeros((b, t), np.int32),
    }
    return to_data_batch(data, 1).batch


def learner_step(model, mesh, steps):
    """`step(tokens) -> (seconds, loss)`: one AdamW update of `model` (the bench's optimizer and loss), timed in
    `steps` (`bench/timed_steps.py`)."""
    from core.config import OptimConfig
    from core.learner import Learner
    from core.pretrain import PRETRAINING

    optim = OptimConfig(name="adamw", learning_rate=1e-4, schedule="constant", weight_decay=0.0)
    learner = Learner(model, mesh, PRETRAINING.loss(None), optim, total_updates=1000)

    def step(tokens) -> tuple[float, float]:
        batch = batch_of(tokens)
        return steps.run(lambda: float(learner.update(batch).loss))  # float(): the step's result is ready

    return step


def temper_side(hf: Path, kernel: str, steps):
    import jax
    from flax import nnx

    from core.hf.directory import load_hf
    from core.mesh import single_device_mesh
    from core.models.moe import MoeBlock

    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model, _ = load_hf(hf, mesh=mesh)
    for _, module in nnx.iter_graph(model):  # `model.moe.kernel`, set before the step is first traced
        if isinstance(module, MoeBlock):
            module.kernel = kernel
    return learner_step(model, mesh, steps)


def step_parts(hf: Path, batch: int, seq: int, floors, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Where the MoE step's time goes, each part beside its floor (FLOPs at the matmul peak plus bytes at the read
    bandwidth), measured by whole steps of models that differ from it in one part: the same model with one dense
    MLP of the active width (2 x 448) in place of the experts; the same with a negligible MLP (width 8: attention,
    embeddings, the output head and its loss, AdamW); and AdamW alone over the MoE's parameters. Medians of
    `repeats` steps after a compiling one."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from bench.timed_steps import TimedSteps
    from core.config import ModelConfig
    from core.hf.directory import load_hf
    from core.mesh import single_device_mesh
    from core.metrics import model_flops_per_token
    from core.models import create_model, param_count

    moe_model, cfg = load_hf(hf)
    assert cfg.moe is not None
    active = cfg.moe.experts_per_token * cfg.moe.intermediate_size
    mesh = single_device_mesh()
    out = {}
    for name, width in (("dense MLP of the active width", active), ("no MLP (width 8)", 8)):
        dense = ModelConfig(**{**cfg.model_dump(), "family": "qwen3", "moe": None, "intermediate_size": width})
        with jax.set_mesh(mesh):
            model = create_model(dense, mesh, seed=0)
        steps = TimedSteps()
        step = learner_step(model, mesh, steps)
        for i in range(repeats + 1):
            step(rows(batch, seq, i))
        flops = batch * seq * model_flops_per_token(dense, seq)
        floor = floors.flops(flops) + floors.read(7 * 4.0 * param_count(model))
        out[name] = {"s": statistics.median(steps.seconds[1:]), "floor_s": floor}
    # AdamW alone: the moments' update over every parameter of the MoE model (zero gradients: the same bytes)
    params = [jnp.asarray(p) for p in jax.tree.leaves(nnx.state(moe_model, nnx.Param))]
    adamw = optax.adamw(1e-4, weight_decay=0.0)

    def update(grads, state, params):  # the moments and the parameters, read and written: 7 x 4 bytes each
        updates, state = adamw.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    adamw_step = jax.jit(update, donate_argnums=(1, 2))
    grads, state = jax.tree.map(jnp.zeros_like, params), adamw.init(params)
    adamw_steps = TimedSteps()
    for _ in range(repeats + 1):
        _, (params, state) = adamw_steps.run(lambda *a: jax.block_until_ready(adamw_step(*a)), grads, state, params)
    total = sum(x.size for x in params)
    out["AdamW alone, the MoE's parameters"] = {
        "s": statistics.median(adamw_steps.seconds[1:]),
        "floor_s": floors.read(7 * 4.0 * total),
    }
    for name, part in out.items():
        print(
            f"part: {name:36s} {part['s']:6.2f} s  floor {part['floor_s']:5.2f} s  ({part['s'] / part['floor_s']:.2f}x)"
        )
    return out


def where_the_step_goes(step: float, parts: dict, alone: dict, kernel: str, total: int, layers: int) -> dict:
    """The MoE step as the sum of its parts: the model without an MLP (attention, embeddings, the head, AdamW over
    its own parameters), the experts alone (`kernel`'s form) in every layer, AdamW over the experts' parameters
    (its share of AdamW alone over the whole model), and what is left (router, sort, combine, fusion)."""
    import jax

    form = "tiled" if kernel == "auto" and jax.default_backend() == "cpu" else kernel
    rest = parts["no MLP (width 8)"]["s"]
    experts = layers * alone[form]["ms"] / 1000
    expert_params = layers * 3 * SHAPE["num_experts"] * SHAPE["hidden_size"] * SHAPE["moe_intermediate_size"]
    adamw = parts["AdamW alone, the MoE's parameters"]["s"] * expert_params / total
    out = {"no_mlp_s": rest, "experts_s": experts, "experts_adamw_s": adamw, "left_s": step - rest - experts - adamw}
    print(
        f"the MoE step {step:.2f} s = no MLP {rest:.2f} + experts ({form}) x {layers} layers {experts:.2f} + AdamW on "
        f"the experts {adamw:.2f} + the rest (router, sort, combine) {out['left_s']:.2f} s"
    )
    return out


def torch_side(hf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def step(tokens) -> tuple[float, float]:
        ids = torch.from_numpy(tokens).long()
        start = time.perf_counter()
        out = model(input_ids=ids, labels=ids, output_router_logits=True)  # loss + 0.001 x aux_loss
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, float(out.loss)

    return step


def step_floor(hf: Path, tokens: int, floors) -> tuple[float, float]:
    """(FLOPs of one training step, its floor in seconds: those FLOPs at the matmul peak plus AdamW's bytes at the
    read bandwidth)."""
    from core.hf.directory import load_hf

    total, _ = counts(hf)
    _, cfg = load_hf(hf)
    moe = cfg.moe
    assert moe is not None
    d, h, n, kv, layers = cfg.hidden_size, cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    attention = d * n * h + 2 * d * kv * h + n * h * d  # q, k, v and o projections
    per_token = layers * (attention + d * moe.num_experts + moe.experts_per_token * 3 * d * moe.intermediate_size)
    per_token += d * cfg.vocab_size  # the output head
    seq = SHAPE["max_position_embeddings"] // 4  # the bench's rows: 256 tokens
    flops = tokens * (6.0 * per_token + 12.0 * layers * seq * n * h)
    return flops, floors.flops(flops) + floors.read(7 * 4.0 * total)


def experts_alone(batch: int, seq: int, repeats: int = 3, peak: float | None = None) -> dict[str, float]:
    """Forward and backward of one layer's experts on `batch` x `seq` tokens: milliseconds (min of repeats) and
    XLA's temporary memory, per form."""
    from functools import partial

    import jax
    import numpy as np

    from core.kernels.experts import (
        capacity_experts,
        dense_experts,
        expert_capacity,
        grouped_experts,
        rounds_experts,
        tiled_experts,
        within_capacity,
    )
    from core.models.moe import route_topk

    d, f, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (batch * seq, d))
    router = jax.random.normal(keys[1], (d, e)) / d**0.5
    ws = [
        jax.random.normal(keys[2 + i], shape) / shape[1] ** 0.5 for i, shape in enumerate([(e, d, f)] * 2 + [(e, f, d)])
    ]
    k = SHAPE["num_experts_per_tok"]
    weights, chosen = route_topk(x @ router, k, True)
    forms = [("rounds", rounds_experts), ("tiled", tiled_experts), ("ragged_dot", grouped_experts)]
    dropped = {}
    for factor in (1.0, 1.25):
        capacity = expert_capacity(batch * seq, k, e, factor)
        name = f"capacity {factor}"
        forms.append((name, partial(capacity_experts, capacity=capacity)))
        dropped[name] = 1.0 - float(np.asarray(within_capacity(chosen, e, capacity)).mean())
    forms.append(("dense", dense_experts))
    active = 3 * 2.0 * batch * seq * k * d * f * 3  # three matmuls, forward and backward (x3), of the k routed
    out = {}
    for name, fn in forms:
        grad = jax.jit(jax.grad(lambda x, a, b, c, fn=fn: fn(x, weights, chosen, a, b, c).sum(), argnums=(0, 1, 2, 3)))
        temp = grad.lower(x, *ws).compile().memory_analysis().temp_size_in_bytes
        jax.block_until_ready(grad(x, *ws))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(grad(x, *ws))
            times.append(time.perf_counter() - start)
        share = active / peak / min(times) if peak else float("nan")
        out[name] = {"ms": 1000 * min(times), "temp_mb": temp / 1e6, "dropped": dropped.get(name, 0.0), "peak": share}
        print(
            f"experts alone, {name:13s} {1000 * min(times):8.1f} ms   temp {temp / 1e6:8.1f} MB   "
            f"dropped {100 * dropped.get(name, 0.0):5.1f}%   active FLOPs at {100 * share:5.1f}% of the matmul peak",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", default="runs/bench_moe.json")
    p.add_argument("--experts-only", action="store_true", help="only the experts alone")
    p.add_argument("--kernel", default="auto", choices=["auto", "tiled", "rounds"], help="Temper's `model.moe.kernel`")
    args = p.parse_args()
    from bench.floors import Floors
    from bench.timed_steps import TimedSteps

    floors = Floors.measure()
    print(floors.line(), flush=True)
    if args.experts_only:
        experts_alone(args.batch, args.seq, peak=floors.peak_flops)
        return

    with tempfile.TemporaryDirectory() as tmp:
        hf = build(Path(tmp))
        total, active = counts(hf)
        print(f"Qwen3-MoE: {total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active; {args.batch} x {args.seq} tokens")
        flops, floor = step_floor(hf, args.batch * args.seq, floors)
        print(f"the step's floor: {flops / 1e9:.0f} GFLOP and AdamW's bytes: {floor:.2f} s", flush=True)
        temper_steps = TimedSteps()
        sides = {"temper": temper_side(hf, args.kernel, temper_steps), "torch": torch_side(hf)}
        times: dict[str, list[float]] = {k: [] for k in sides}
        losses: dict[str, list[float]] = {k: [] for k in sides}
        first: dict[str, float] = {}
        for step in range(args.steps + 1):  # step 0: warm-up (compilation), not counted
            tokens = rows(args.batch, args.seq, step)
            for name, run in sides.items():
                seconds, loss = run(tokens)
                if step:
                    times[name].append(seconds)
                else:
                    first[name] = seconds
                losses[name].append(loss)
                print(f"step {step} {name:6s} {seconds:7.2f} s  loss {loss:.4f}", flush=True)
        del sides
        parts = step_parts(hf, args.batch, args.seq, floors)
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["temper"] / medians["torch"]
    print(
        f"median step: Temper {medians['temper']:.2f} s ({medians['temper'] / floor:.2f}x the floor; its first step, "
        f"compiling, {first['temper']:.1f} s), torch {medians['torch']:.2f} s ({medians['torch'] / floor:.2f}x): "
        f"ratio {ratio:.2f}"
    )
    print(f"Temper: {temper_steps.line()}")
    alone = experts_alone(args.batch, args.seq, peak=floors.peak_flops)
    breakdown = where_the_step_goes(medians["temper"], parts, alone, args.kernel, total, SHAPE["num_hidden_layers"])
    result = {
        "params": total,
        "active": active,
        "batch": args.batch,
        "seq": args.seq,
        "kernel": args.kernel,
        "times": times,
        "losses": losses,
        "median_s": medians,
        "ratio": ratio,
        "floor_s": floor,
        "step_gflop": flops / 1e9,
        "first_step_s": first,
        "temper_steps": temper_steps.summary(),
        "floors": vars(floors),
        "experts_alone": alone,
        "parts": parts,
        "breakdown": breakdown,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
