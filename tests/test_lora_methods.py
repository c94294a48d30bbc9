"""LoRA on every method: each trains its policy's (or student's) adapters alone, with its base frozen, and each
method that has a reference reads the policy with its adapters off."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from core.config_loader import load_config
from core.mesh import single_device_mesh
from core.models import create_model
from posttrain.config import PostTrainConfig
from tests.helpers import next_loss_batch

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def adapters_only(learner) -> None:
    """The learner trains adapters alone: every trainable path a LoRA factor, a feature projection, or nothing
    else."""
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.params)]
    assert paths and all(p.endswith(("lora.a", "lora.b")) or p.startswith("projections.") for p in paths), paths


def frozen_base(learner):
    return jax.tree.map(np.asarray, learner.rest)


def same(a, b) -> bool:
    return all(np.array_equal(x, np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _sft_cfg(tmp_path, tokenizer, *overrides):
    return load_config(
        "recipes/configs/sft_tiny.yml",
        [
            f"run.run_dir={tmp_path}",
            f"data.tokenizer_dir={tokenizer}",
            "train.eval_every=0",
            "checkpoint.async_save=false",
            *LORA,
            *overrides,
        ],
        schema=PostTrainConfig,
    )


def test_sft_trains_adapters_learns_and_exports_them(tmp_path, arithmetic_tokenizer):
    """SFT with `model.lora` (from the recipe's config): the loss goes down over 12 steps with only adapters
    trained, the base unchanged; the export is the merged model plus a PEFT adapter directory."""
    from core.run import build_run
    from posttrain.sft import SFT

    cfg = _sft_cfg(tmp_path, arithmetic_tokenizer, "train.steps=12", "train.log_every=4", "optim.learning_rate=1.0e-2")
    run = build_run(cfg, SFT)
    learner = run.loop.learner
    adapters_only(learner)
    base = frozen_base(learner)
    run.fit()
    assert same(base, learner.rest)
    from core.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    first, last = np.mean(losses[:4]), np.mean(losses[-4:])
    assert len(losses) == 12 and last < first - 0.2, losses  # every step logged
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "adapter" / "adapter_config.json").exists()


def test_qlora_sft_steps_checkpoints_and_exports_a_model_transformers_loads(tmp_path, arithmetic_tokenizer):
    """SFT on an NF4 base (`model.lora.quantize_base=nf4`): the steps run with a finite, non-zero gradient, the
    checkpoint holds the adapters alone (not the codes), and the export (adapters merged into the dequantized
    base) loaded by transformers gives the trained model's logits."""
    import torch
    import transformers

    from core.run import build_run
    from posttrain.sft import SFT
    from tests.helpers import saved_tensors

    cfg = _sft_cfg(
        tmp_path,
        arithmetic_tokenizer,
        "train.steps=3",
        "train.log_every=1",
        "model.lora.quantize_base=nf4",
        "model.lora.quant_block_size=32",
    )
    run = build_run(cfg, SFT)
    learner = run.loop.learner
    adapters_only(learner)
    assert any("Quantized" in type(v).__name__ for _, v in nnx.to_flat_state(learner.rest))
    run.fit()
    from core.metrics import read_metrics

    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows), rows
    saved = saved_tensors(tmp_path / "checkpoints" / "3")
    assert saved and all(p.endswith(("lora.a", "lora.b")) for p in saved), saved  # not the base's codes
    x = np.random.default_rng(3).integers(1, cfg.model.vocab_size, (2, 12))
    ours = np.asarray(learner.model()(jax.numpy.asarray(x, jax.numpy.int32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(x)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)


def _dpo_cfg(tmp_path, tokenizer, *overrides):
    return load_config(
        "recipes/configs/dpo_tiny.yml",
        [
            f"run.run_dir={tmp_path}",
            f"data.tokenizer_dir={tokenizer}",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
            *LORA,
            *overrides,
        ],
        schema=PostTrainConfig,
    )


@pytest.mark.parametrize("precompute", [False, True])
def test_offline_dpo_reference_is_the_policy_with_its_adapters_off(tmp_path, arithmetic_tokenizer, precompute):
    """Offline DPO with LoRA: the reference log-probs a batch carries (live or precomputed) are the base model's
    (the policy with adapters off: no second copy of the model), and one update trains the adapters alone."""
    from core.models.adapters import adapters_off
    from core.run import build_run
    from posttrain.dpo.offline import DPO
    from posttrain.frozen import FrozenModel

    cfg = _dpo_cfg(tmp_path, arithmetic_tokenizer, f"dpo.precompute_ref_logps={str(precompute).lower()}")
    run = build_run(cfg, DPO)
    learner = run.loop.learner
    adapters_only(learner)
    assert any("LoRA adapters off" in note for note in run.parts.notes)
    batch = next_loss_batch(run)
    model = learner.model()
    # an independent reference: the base alone, a Decoder without adapters, built from the learner's frozen state
    base = FrozenModel.copy_of(adapters_off(model), learner.mesh, "base")
    logp = base.logprobs(batch.packed).sum(axis=-1)
    np.testing.assert_allclose(np.asarray(batch.ref_chosen), logp[0::2], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(batch.ref_rejected), logp[1::2], rtol=1e-5)
    before = frozen_base(learner)
    update = learner.update(batch, cfg.train.micro_batches)
    assert update.applied and update.grad_norm > 0 and same(before, learner.rest)
    # After the update the adapters are no longer zero, so "adapters off" and "adapters on" differ: the next
    # batch's reference must still be the base's log-probs, not the trained policy's.
    batch = next_loss_batch(run)
    model = learner.model()
    base = FrozenModel.copy_of(adapters_off(model), learner.mesh, "base").logprobs(batch.packed).sum(axis=-1)
    policy = FrozenModel.copy_of(model, learner.mesh, "policy").logprobs(batch.packed).sum(axis=-1)
    assert np.abs(policy - base).max() > 1e-4  # the check below can tell the two apart
    np.testing.assert_allclose(np.asarray(batch.ref_chosen), base[0::2], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(batch.ref_rejected), base[1::2], rtol=1e-5)
    # and a reference built now, with the adapters trained (as a resumption builds it), is the base too
    assert_reads_the_base(FrozenModel.start_of(learner), model, learner.mesh, batch.packed)


def _policy_model(cfg):
    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        return create_model(cfg.model, mesh, seed=0), mesh


def assert_reads_the_base(reference, policy, mesh, packed) -> None:
    """`reference`'s log-probs on `packed` are the base's (`policy` with its adapters off), which differ from the
    policy's own (so that the check can fail)."""
    from core.models.adapters import adapters_off
    from posttrain.frozen import FrozenModel

    base = FrozenModel.copy_of(adapters_off(policy), mesh, "base").logprobs(packed)
    own = FrozenModel.copy_of(policy, mesh, "policy").logprobs(packed)
    assert np.abs(own - base).max() > 1e-4
    np.testing.assert_allclose(reference.logprobs(packed), base, rtol=1e-5, atol=1e-6)


def test_a_reference_built_while_the_adapters_are_trained_is_still_the_base(arithmetic_tokenizer):
    """A run that starts from trained adapters (a PEFT adapter, or a resumption): online DPO's reference, built
    when the adapters are already non-zero, is the base, not the policy (TRL's reference for a PEFT model)."""
    from core.method_learner import MethodLearner
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.dpo.pairs import Pair, build_pair_batch

    cfg = load_config("recipes/configs/dpo_online_tiny.yml", [*LORA, "train.steps=1"], schema=PostTrainConfig)
    model, mesh = _policy_model(cfg)
    adapters = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(adapters))))
    trained = lambda a: jax.device_put(0.05 * jax.random.normal(next(keys), a.shape, a.dtype), a.sharding)
    nnx.update(model, jax.tree.map(trained, adapters))
    learner = MethodLearner(cfg, ONLINE_DPO, model, mesh)
    rng = np.random.default_rng(0)
    ids = lambda n: tuple(int(x) for x in rng.integers(3, 500, n))
    pairs = [Pair(i, ids(4), ids(5), ids(3)) for i in range(4)]
    batch = build_pair_batch(pairs, slots=len(pairs), row_len=64, groups=1)
    assert_reads_the_base(learner.attach.reference, learner.learner.model(), mesh, batch.packed)


def test_online_dpo_and_grpo_learners_train_adapters_against_the_adapters_off_reference(arithmetic_tokenizer):
    """The on-policy learners with LoRA: online DPO's and GRPO's (with a KL term) reference is the policy with its
    adapters off, sharing the base's arrays; each step trains the adapters alone."""
    from core.method_learner import MethodLearner
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.dpo.pairs import Pair, build_pair_batch
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.rl_batch import build_rl_batch
    from rollout.sampler import Completion

    rng = np.random.default_rng(0)
    ids = lambda n: tuple(int(x) for x in rng.integers(3, 500, n))
    dpo_cfg = load_config("recipes/configs/dpo_online_tiny.yml", [*LORA, "train.steps=2"], schema=PostTrainConfig)
    model, mesh = _policy_model(dpo_cfg)
    learner = MethodLearner(dpo_cfg, ONLINE_DPO, model, mesh)
    adapters_only(learner.learner)
    reference = learner.attach.reference
    ref_base = nnx.state(reference.model, nnx.Not(nnx.LoRAParam))
    for a, b in zip(jax.tree.leaves(ref_base), jax.tree.leaves(learner.learner.rest)):
        assert a is b  # the reference reads the policy's own frozen base
    pairs = [Pair(i, ids(4), ids(5), ids(3)) for i in range(dpo_cfg.rl.batch.prompts_per_step)]
    batch = build_pair_batch(pairs, slots=len(pairs), row_len=64, groups=dpo_cfg.train.micro_batches)
    stats = learner.train(batch)
    # policy == reference at the first update (B = 0): DPO's sigmoid loss is log 2
    assert abs(stats.metrics["loss"] - np.log(2)) < 1e-4 and stats.metrics["grad_norm"] > 0
    # After it the adapters are not zero: the reference must still read the base, not the trained policy.
    assert_reads_the_base(reference, learner.learner.model(), mesh, batch.packed)

    grpo_cfg = load_config(
        "recipes/configs/grpo_tiny.yml", [*LORA, "rl.loss.beta=0.1", "train.steps=2"], schema=PostTrainConfig
    )
    model, mesh = _policy_model(grpo_cfg)
    learner = MethodLearner(grpo_cfg, GRPO, model, mesh)
    adapters_only(learner.learner)
    comps = [Completion(list(ids(4)), list(ids(5)), [-3.0] * 5, "stop", "") for _ in range(8)]
    batch = build_rl_batch(comps, rng.normal(size=8), np.ones(8, bool), row_len=32, max_tokens=8, groups=1)
    base = frozen_base(learner.learner)
    for _ in range(2):
        metrics = learner.train(batch).metrics
    assert metrics["kl"] > 0 and metrics["grad_norm"] > 0  # the second step's policy has left its reference
    assert same(base, learner.learner.rest)


def distill_batch(loss: str):
    """8 sampled completions of one prompt as on-policy distillation's batch: the RL batch for the sampled-token
    loss, a `DistillBatch` (alpha 0, temperature 1) for GKD."""
    from posttrain.distill.objective import DistillBatch
    from posttrain.onpolicy.rl_batch import build_rl_batch
    from rollout.sampler import Completion

    rng = np.random.default_rng(1)
    comps = [Completion([5, 6, 7], [int(x) for x in rng.integers(3, 500, 6)], [-4.0] * 6, "stop", "") for _ in range(8)]
    batch = build_rl_batch(comps, np.zeros(8), np.ones(8, bool), row_len=32, max_tokens=8, groups=1)
    if loss == "gkd":
        rows = batch.packed.tokens.shape[0]
        return DistillBatch(batch.packed, np.zeros(rows, np.float32), np.ones(rows, np.float32))
    return batch


@pytest.mark.parametrize("loss", ["sampled", "gkd"])
def test_on_policy_distillation_trains_the_students_adapters(tmp_path, arithmetic_tokenizer, rollout_model_dir, loss):
    """On-policy distillation's learners (the sampled-token reverse KL, and GKD with the teacher in the step) on a
    student with LoRA: the adapters train, the teacher and the student's base do not."""
    from core.method_learner import MethodLearner
    from posttrain.distill.onpolicy import ON_POLICY_DISTILL

    teacher = rollout_model_dir("llama", seed=1)
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [*LORA, f"distill.teacher={teacher}", f"distill.on_policy_loss={loss}", "model.hidden_size=128",
         "model.head_dim=32", "train.steps=2"],
        schema=PostTrainConfig,
    )  # fmt: skip
    model, mesh = _policy_model(cfg)
    learner = MethodLearner(cfg, ON_POLICY_DISTILL, model, mesh)
    adapters_only(learner.learner)
    batch = distill_batch(loss)
    if loss == "gkd":
        assert "teacher" not in learner.learner.params
    base = frozen_base(learner.learner)
    learner.train(batch)
    metrics = learner.train(batch).metrics
    assert metrics["grad_norm"] > 0 and same(base, learner.learner.rest)


@pytest.mark.parametrize("regime", ["offline", "online"])
def test_offline_and_online_distillation_train_the_students_adapters_and_projections(
    tmp_path, arithmetic_tokenizer, rollout_model_dir, regime
):
    """Offline (a teacher's top-k dump) and online (the teacher in the step, a feature loss through learned
    projections) distillation into a student with LoRA: the adapters and the projections train, nothing else."""
    from core.run import build_run
    from posttrain.distill.method import DISTILL

    teacher = rollout_model_dir("qwen2", seed=1)
    common = [
        f"data.tokenizer_dir={arithmetic_tokenizer}",
        f"distill.teacher={teacher}",
        "data.num_examples=64",
        "train.batch_size=4",
        "train.eval_every=0",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
        "model.hidden_size=64",
        "model.head_dim=16",
        *LORA,
    ]
    if regime == "offline":
        from recipes.distill_logits import main as dump

        topk = f"distill.logits_dir={tmp_path / 'topk'}"
        assert dump(["recipes/configs/distill_tiny.yml", *common, topk, f"run.run_dir={tmp_path / 'dump'}"]) == 0
        overrides = [*common, topk, "distill.regime=offline"]
    else:
        overrides = [*common, "distill.regime=online", "distill.feature_layers=[[1,1]]", "distill.feature_weight=1.0"]
    cfg = load_config(
        "recipes/configs/distill_tiny.yml", [*overrides, f"run.run_dir={tmp_path / 'run'}"], schema=PostTrainConfig
    )
    run = build_run(cfg, DISTILL)
    learner = run.loop.learner
    adapters_only(learner)
    trained = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.params)}
    assert any(p.startswith("projections.") for p in trained) == (regime == "online")
    base = frozen_base(learner)
    batch = next_loss_batch(run)
    update = learner.update(batch, cfg.train.micro_batches)
    assert update.applied and update.grad_norm > 0 and same(base, learner.rest)
    run.loop.trainer.close()
