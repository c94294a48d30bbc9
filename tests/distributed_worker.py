"""One process of a JAX process group (or the whole of a one-process run) taking one step of each method's loss on
the same global batch over a mesh of 8 devices (fsdp 4 x tensor 2): pretraining, SFT, DPO, distillation (online,
the teacher in the step), GRPO, and a mixture-of-experts pretraining step on an expert-parallel mesh (expert 4 x
tensor 2). Process 0 writes each step's loss and gradient (gathered whole) to OUT.

    python tests/distributed_worker.py OUT NUM_PROCESSES PROCESS_ID PORT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OUT, N, PID, PORT = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.host_devices import with_host_device_count  # noqa: E402

os.environ["XLA_FLAGS"] = with_host_device_count(os.environ.get("XLA_FLAGS", ""), 8 // N)

from core.distributed import ProcessGroup, join, local_indices, to_host  # noqa: E402

join(ProcessGroup(f"127.0.0.1:{PORT}", N, PID, timeout_s=120))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from core.config import LoraConfig, MeshConfig, ModelConfig, MoeConfig, OptimConfig  # noqa: E402
from core.config_loader import load_config  # noqa: E402
from core.data import to_data_batch  # noqa: E402
from core.learner import Learner  # noqa: E402
from core.mesh import make_mesh  # noqa: E402
from core.method_learner import MethodLearner  # noqa: E402
from core.models import create_model  # noqa: E402
from core.pretrain import PRETRAINING  # noqa: E402
from core.train import batch_shards, place_batch, split_micro_batches  # noqa: E402
from posttrain.config import DPOConfig, PostTrainConfig  # noqa: E402
from posttrain.distill.objective import (  # noqa: E402
    DistillBatch,
    DistillModules,
    DistillSettings,
    distill_objective,
    trainable,
)
from posttrain.dpo.objective import preference_objective  # noqa: E402
from posttrain.dpo.pairs import Pair, build_pair_batch  # noqa: E402
from posttrain.grpo import GRPO  # noqa: E402
from posttrain.onpolicy.rl_batch import build_rl_batch  # noqa: E402
from posttrain.sft import SFT  # noqa: E402
from rollout.sampler import Completion  # noqa: E402
from tests.helpers import recording_sgd  # noqa: E402
from tests.test_train_step import make_batch  # noqa: E402

assert jax.device_count() == 8 and jax.process_count() == N
MESH = make_mesh(MeshConfig(fsdp=4, tensor=2))
MODEL = ModelConfig(family="qwen2", attention_bias=True, num_layers=2)
results: dict[str, np.ndarray] = {}


def collectives_known_answers() -> None:
    """psum, psum_scatter (large chunks: jax issue 40830 saw wrong values there) and all_gather over the 8 devices
    against NumPy: the collectives under the steps below, checked on the pinned JAX before they are trusted."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = make_mesh(MeshConfig(fsdp=8))
    x = np.arange(8 * 8 * 131072, dtype=np.float32).reshape(8, 8 * 131072) % 977  # 4 MiB a device
    placed = jax.device_put(x, NamedSharding(devices, P("fsdp")))

    def body(block):
        total = jax.lax.psum(block, "fsdp")
        scattered = jax.lax.psum_scatter(block[0], "fsdp", tiled=True)
        gathered = jax.lax.all_gather(block[:, :4], "fsdp", tiled=True)
        return total, scattered[None], gathered[None]

    f = jax.shard_map(body, mesh=devices, in_specs=P("fsdp"), out_specs=(P(), P("fsdp"), P("fsdp")))
    total, scattered, gathered = to_host(jax.jit(f)(placed))
    want = x.sum(0, keepdims=True)
    np.testing.assert_array_equal(total, want)
    np.testing.assert_array_equal(scattered.reshape(-1), want[0])
    np.testing.assert_array_equal(gathered[0], x[:, :4])


def record(name: str, loss: float, grads) -> None:
    host = to_host(grads)  # a collective: every process
    results[f"{name}/loss"] = np.asarray(loss)
    for i, leaf in enumerate(jax.tree.leaves(host)):
        results[f"{name}/grad/{i:03d}"] = leaf


def text_rows(seed: int, prompt: int) -> dict:
    """`tests.test_train_step.make_batch`'s rows (packed documents, padding), the first `prompt` tokens of a row
    without loss."""
    rows = make_batch(rows=8, t=32, seed=seed)
    rows["loss_mask"] = (rows["segment_ids"] > 0).astype(np.int32)
    rows["loss_mask"][:, :prompt] = 0
    return {**rows, "example_ids": rows["segment_ids"] - 1}


def check_placement(name: str, batch, micro: int) -> None:
    """The global batch each process assembles from its own rows equals the host batch, leaf by leaf; in a group,
    each process transferred only its share of the rows when the rows split over all 4 data shards (2 rows a
    micro-batch, as DPO's pairs here, split over 2 of them: both processes hold both)."""
    host = split_micro_batches(batch, micro, MESH)
    placed = place_batch(host, MESH)
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(placed), strict=True):
        rows = local_indices(got.sharding, got.shape, axis=1)
        if N > 1:
            assert not got.is_fully_addressable, (name, path)
            share = want.shape[1] // N if want.shape[1] % batch_shards(MESH) == 0 else want.shape[1]
            assert len(rows) == share, (name, path, rows)
        np.testing.assert_array_equal(to_host(got), want, err_msg=f"{name}{jax.tree_util.keystr(path)}")


def offline_step(name: str, loss_fn, batch, micro: int, tree=None, trainable=None, model_cfg=MODEL, mesh=MESH) -> None:
    """One update of `loss_fn` on a fresh model (of `model_cfg`), or on the module tree `tree(model)`."""
    if mesh is MESH:
        check_placement(name, batch, micro)
    with jax.set_mesh(mesh):
        model = create_model(model_cfg, mesh, seed=0)
    modules = model if tree is None else tree(model)
    learner = Learner(
        modules, mesh, loss_fn, OptimConfig(), total_updates=1, tx=recording_sgd(0.1), trainable=trainable
    )
    update = learner.update(batch, micro)
    assert update.finite == 1.0 and update.empty == 0.0 and update.grad_norm > 0, (name, update)
    record(name, update.loss, learner.state.opt_state)


collectives_known_answers()
offline_step("pretrain", PRETRAINING.loss(None), to_data_batch(text_rows(0, 0), 2).batch, 2)
cfg = PostTrainConfig()
offline_step("sft", SFT.loss(cfg), to_data_batch(text_rows(1, 6), 2).batch, 2)
# LoRA SFT: the adapters of every projection train (rsLoRA scale, dropout on: its keys are the step's), the base is
# frozen; the adapters' B starts at zero, so B gets the gradient and A none at the first step: the recorded
# gradients are both.
lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1, use_rslora=True)
offline_step(
    "sft_lora",
    SFT.loss(cfg),
    to_data_batch(text_rows(1, 6), 2).batch,
    2,
    model_cfg=MODEL.model_copy(update={"lora": lora}),
)

# A mixture of experts (Qwen3-MoE, 8 experts, top-2, the router terms on) with expert parallelism: the experts split
# over expert 4 x tensor 2; each expert group spans both processes' devices, so tokens cross between processes.
moe = ModelConfig(
    family="qwen3_moe",
    qk_norm=True,
    num_layers=2,
    moe=MoeConfig(num_experts=8, load_balance_weight=0.1, router_z_loss_weight=0.01),
)
moe_mesh = make_mesh(MeshConfig(fsdp=1, expert=4, tensor=2))
for t in range(2):  # the devices of one expert group (all expert positions at tensor index t)
    group = moe_mesh.devices[0, 0, :, t, 0]
    assert len({d.process_index for d in group}) == N, [d.process_index for d in group]
offline_step("moe", PRETRAINING.loss(None), to_data_batch(text_rows(3, 0), 1).batch, 1, model_cfg=moe, mesh=moe_mesh)

rng = np.random.default_rng(4)
ids = lambda k: tuple(int(x) for x in rng.integers(1, 512, k))
pairs = [Pair(i, ids(rng.integers(3, 20)), ids(rng.integers(2, 16)), ids(rng.integers(2, 16))) for i in range(8)]
refs = {k: rng.normal(-60, 5, 8).astype(np.float32) for k in ("ref_chosen", "ref_rejected")}
pair_batch = build_pair_batch(pairs, slots=8, row_len=96, groups=2).replace(**refs)
offline_step("dpo", preference_objective(DPOConfig(loss_type="sigmoid")), pair_batch, 2)

# Distillation, online: the teacher (another model) in the step, the forward KL at T = 2 over the whole vocabulary
# with a hard-label share, and a feature loss between a student and a teacher layer.
with jax.set_mesh(MESH):
    teacher = create_model(MODEL, MESH, seed=7)
packed = to_data_batch(text_rows(2, 4), 2).batch
rows = packed.tokens.shape[0]
distill_batch = DistillBatch(
    packed,
    alpha=np.full(rows, 0.25, np.float32),
    temperature=np.full(rows, 2.0, np.float32),
    feature_weight=np.full(rows, 0.5, np.float32),
)
settings = DistillSettings(kind="forward", unit_temperature=False, feature_layers=((1, 2),))
offline_step(
    "distill",
    distill_objective(settings, MODEL),
    distill_batch,
    2,
    tree=lambda model: DistillModules(model, teacher=teacher),
    trainable=trainable(nnx.Param),
)

# GRPO: the policy learner's whole step (its pi_old pass, the clipped objective), one update on 16 completions.
grpo = load_config("recipes/configs/grpo_tiny.yml", ["train.micro_batches=2", "train.steps=1"], schema=PostTrainConfig)
rng = np.random.default_rng(1)
prompts = [list(rng.integers(3, 512, rng.integers(2, 9))) for _ in range(4)]
comps = []
for i in range(16):
    tokens = list(rng.integers(3, 512, rng.integers(1, 7)))
    comps.append(Completion(prompts[i // 4], tokens, list(-rng.uniform(4, 7, len(tokens))), "stop", ""))
adv, keep = rng.normal(size=16), np.ones(16, bool)
rl_batch = build_rl_batch(comps, adv, keep, row_len=32, max_tokens=6, groups=2, pack=True)  # 2 micro-batches
check_placement("grpo", rl_batch, 2)
with jax.set_mesh(MESH):
    model = create_model(grpo.model, MESH, seed=0)
policy = MethodLearner(grpo, GRPO, model, MESH, tx=recording_sgd(0.1))
metrics = policy.train(rl_batch).metrics
assert np.isfinite(metrics["loss"]), metrics
record("grpo", metrics["loss"], policy.learner.state.opt_state)

if PID == 0:
    np.savez(OUT, **results)
print(f"process {PID} of {N}: {len(results)} arrays", flush=True)
