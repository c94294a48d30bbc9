"""Every method on a mixture-of-experts model: pretraining and SFT learn and export, offline and online DPO, GRPO
and on-policy distillation (an MoE teacher and student) take their steps, each with the router terms in its loss
and the router metrics in its log."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.config_loader import load_config
from core.hf.directory import load_hf
from core.metrics import read_metrics
from core.run import build_run
from posttrain.config import PostTrainConfig
from tests.helpers import next_loss_batch
from tests.test_lora_methods import _policy_model, distill_batch

ROUTER = ("moe/load_balance_loss", "moe/z_loss", "moe/expert_load_max", "moe/expert_load_min", "moe/expert_load_cv")
# A Qwen3-MoE policy for the recipes whose model section is a dense Qwen2 (GRPO, online DPO): 4 experts, top-2.
QWEN3_MOE = [
    "model.family=qwen3_moe",
    "model.attention_bias=false",
    "model.qk_norm=true",
    "model.moe={num_experts: 4, experts_per_token: 2, intermediate_size: 32, load_balance_weight: 0.01}",
]


def _run_cfg(recipe, tmp_path, tokenizer, *overrides):
    return load_config(
        recipe,
        [
            f"run.run_dir={tmp_path}",
            f"data.tokenizer_dir={tokenizer}",
            "train.eval_every=0",
            "checkpoint.async_save=false",
            *overrides,
        ],
        schema=PostTrainConfig,
    )


def test_sft_learns_on_an_moe_model_and_exports_what_transformers_loads(tmp_path, arithmetic_tokenizer):
    """SFT of the tiny Qwen3-MoE preset: the loss falls over 8 steps, the router metrics are logged each step,
    and the exported checkpoint, loaded by transformers, gives the trained model's logits."""
    from posttrain.sft import SFT

    cfg = _run_cfg(
        "recipes/configs/sft_tiny.yml",
        tmp_path,
        arithmetic_tokenizer,
        "model.preset=tiny-qwen3-moe",
        "model.hidden_size=64",  # the preset's shape, not the recipe's
        "model.intermediate_size=128",
        "model.num_layers=2",
        "train.batch_size=8",
        "train.steps=8",
        "train.log_every=4",
        "optim.learning_rate=1.0e-2",
    )
    run = build_run(cfg, SFT)
    run.fit()
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    first, last = (np.mean([r["loss"] for r in half]) for half in (rows[:4], rows[4:]))
    assert len(rows) == 8 and last < first - 1.0, [r["loss"] for r in rows]  # every step logged
    assert all(all(k in r for k in ROUTER) for r in rows)
    trained = run.loop.learner.model()
    tokens = np.random.RandomState(0).randint(3, 500, (2, 24))
    ours = np.asarray(trained(tokens.astype(np.int32)))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-4


def test_pretraining_a_mixtral_from_scratch_learns(tmp_path, arithmetic_tokenizer):
    from core.pretrain import PRETRAINING

    cfg = load_config(
        "recipes/configs/pretrain_tiny.yml",
        [
            f"run.run_dir={tmp_path}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "model.preset=tiny-mixtral",
            "model.hidden_size=64",
            "model.intermediate_size=32",
            "model.head_dim=16",
            "model.num_layers=2",
            "data.seq_len=64",
            "train.batch_size=8",
            "train.steps=8",
            "train.log_every=4",
            "train.eval_every=0",
            "checkpoint.enabled=false",
        ],
    )
    assert cfg.model.family == "mixtral" and cfg.model.moe is not None and cfg.checkpoint.export_hf
    run = build_run(cfg, PRETRAINING)
    run.fit()
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    first, last = (np.mean([r["loss"] for r in half]) for half in (rows[:4], rows[4:]))
    assert last < first - 1.0 and all(k in rows[-1] for k in ROUTER)
    # the export: transformers' Mixtral, loaded from it, gives the trained model's logits
    tokens = np.random.RandomState(0).randint(3, 500, (2, 24))
    ours = np.asarray(run.loop.learner.model()(tokens.astype(np.int32)))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(hf).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-4


def test_offline_dpo_on_an_moe_policy_adds_the_policys_router_term_only(tmp_path, arithmetic_tokenizer):
    """At the first update the policy is its reference, so DPO's sigmoid loss is log 2; the loss the step reports
    is that plus the policy's weighted load-balancing term (the frozen reference's routers add nothing)."""
    from posttrain.dpo.offline import DPO

    cfg = _run_cfg(
        "recipes/configs/dpo_tiny.yml",
        tmp_path,
        arithmetic_tokenizer,
        "model.preset=tiny-qwen3-moe",
        "model.moe.load_balance_weight=0.05",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
    )
    run = build_run(cfg, DPO)
    learner = run.loop.learner
    batch = next_loss_batch(run)
    update = learner.update(batch, cfg.train.micro_batches)
    metrics = update.metrics()
    assert update.applied and update.grad_norm > 0
    expected = np.log(2) + 0.05 * metrics["moe/load_balance_loss"]
    assert abs(metrics["loss"] - expected) < 1e-4, (metrics["loss"], expected)


def test_grpo_and_online_dpo_learners_step_an_moe_policy(arithmetic_tokenizer):
    """GRPO (with a KL reference: a frozen MoE copy) and online DPO on a Qwen3-MoE policy: each step applies its
    update with a non-zero gradient and logs the router metrics."""
    from core.method_learner import MethodLearner
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.dpo.pairs import Pair, build_pair_batch
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.rl_batch import build_rl_batch
    from rollout.sampler import Completion

    rng = np.random.default_rng(0)
    ids = lambda n: tuple(int(x) for x in rng.integers(3, 500, n))
    grpo_cfg = load_config(
        "recipes/configs/grpo_tiny.yml", [*QWEN3_MOE, "rl.loss.beta=0.1", "train.steps=2"], schema=PostTrainConfig
    )
    model, mesh = _policy_model(grpo_cfg)
    learner = MethodLearner(grpo_cfg, GRPO, model, mesh)
    comps = [Completion(list(ids(4)), list(ids(5)), [-3.0] * 5, "stop", "") for _ in range(8)]
    batch = build_rl_batch(comps, rng.normal(size=8), np.ones(8, bool), row_len=32, max_tokens=8, groups=1)
    for _ in range(2):
        metrics = learner.train(batch).metrics
    assert metrics["kl"] > 0 and metrics["grad_norm"] > 0 and all(k in metrics for k in ROUTER)

    dpo_cfg = load_config("recipes/configs/dpo_online_tiny.yml", [*QWEN3_MOE, "train.steps=2"], schema=PostTrainConfig)
    model, mesh = _policy_model(dpo_cfg)
    dpo = MethodLearner(dpo_cfg, ONLINE_DPO, model, mesh)
    pairs = [Pair(i, ids(4), ids(5), ids(3)) for i in range(dpo_cfg.rl.batch.prompts_per_step)]
    stats = dpo.train(build_pair_batch(pairs, slots=len(pairs), row_len=64, groups=dpo_cfg.train.micro_batches))
    assert stats.metrics["grad_norm"] > 0 and all(k in stats.metrics for k in ROUTER)


@pytest.mark.parametrize("loss", ["sampled", "gkd"])
def test_on_policy_distillation_from_an_moe_teacher_into_an_moe_student(rollout_model_dir, loss):
    from core.method_learner import MethodLearner
    from posttrain.distill.onpolicy import ON_POLICY_DISTILL

    teacher = rollout_model_dir("qwen3_moe", seed=1)
    assert load_hf(teacher)[1].moe is not None
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            *QWEN3_MOE,
            f"distill.teacher={teacher}",
            f"distill.on_policy_loss={loss}",
            "model.hidden_size=128",
            "train.steps=2",
        ],
        schema=PostTrainConfig,
    )
    model, mesh = _policy_model(cfg)
    learner = MethodLearner(cfg, ON_POLICY_DISTILL, model, mesh)
    batch = distill_batch(loss)
    learner.train(batch)
    metrics = learner.train(batch).metrics
    assert metrics["grad_norm"] > 0 and all(k in metrics for k in ROUTER)


@pytest.mark.parametrize("regime", ["offline", "online"])
def test_offline_and_online_distillation_into_an_moe_student(tmp_path, arithmetic_tokenizer, rollout_model_dir, regime):
    """Offline (an MoE teacher's top-k dump) and online (the MoE teacher in the step) distillation into a Qwen3-MoE
    student: an update applies with a non-zero gradient, and the loss the step reports is the distillation loss
    plus the student's weighted load-balancing term alone (the frozen teacher's routers add nothing)."""
    from posttrain.distill.method import DISTILL

    teacher = rollout_model_dir("qwen3_moe", seed=1)
    common = [
        f"distill.teacher={teacher}",
        "data.num_examples=32",
        "train.batch_size=4",
        "checkpoint.enabled=false",
        "checkpoint.export_hf=false",
        *QWEN3_MOE,
        "model.hidden_size=64",
        "model.head_dim=16",
        "model.moe.load_balance_weight=0.05",
    ]
    if regime == "offline":
        from recipes.distill_logits import main as dump

        topk = f"distill.logits_dir={tmp_path / 'topk'}"
        dump_cfg = [*common, topk, f"run.run_dir={tmp_path / 'dump'}", f"data.tokenizer_dir={arithmetic_tokenizer}"]
        assert dump(["recipes/configs/distill_tiny.yml", *dump_cfg]) == 0
        overrides = [*common, topk, "distill.regime=offline"]
    else:
        overrides = [*common, "distill.regime=online"]
    cfg = _run_cfg("recipes/configs/distill_tiny.yml", tmp_path / "run", arithmetic_tokenizer, *overrides)
    assert cfg.model.moe is not None
    run = build_run(cfg, DISTILL)
    learner = run.loop.learner
    batch = next_loss_batch(run)
    update = learner.update(batch, cfg.train.micro_batches)
    metrics = update.metrics()
    assert update.applied and update.grad_norm > 0 and all(k in metrics for k in ROUTER)
    assert metrics["moe/load_balance_loss"] > 0
    distill_only = metrics["loss"] - 0.05 * metrics["moe/load_balance_loss"]
    assert abs(distill_only - metrics["kd"]) < 1e-4, metrics  # alpha 0, T 1: the loss is the divergence
    run.loop.trainer.close()


@pytest.mark.parametrize("mode", ["replay", "off"])
def test_grpo_trains_with_the_samplers_routes_only_with_replay(tmp_path, arithmetic_tokenizer, monkeypatch, mode):
    """GRPO on a Qwen3-MoE policy with the JAX sampler, whose routes are shifted to other experts (every token's
    experts + 1) before they reach the batch. Without replay the trainer routes as the sampler did: every (token,
    layer) counts as routed differently from the shifted routes, and the log-probs stay the sampler's. With replay
    the trainer runs the shifted experts: its log-probs leave the sampler's (and past the first sparse layer its own
    top-k is taken on other hidden states, so a few pairs happen to agree)."""
    from posttrain.fit import fit
    from posttrain.grpo import GRPO
    from rollout.jax_sampler import JaxSampler

    generate = JaxSampler.generate

    def shifted(self, prompts, params):
        out = generate(self, prompts, params)
        for c in out:
            assert c.routes is not None
            c.routes = (c.routes + 1) % 4  # 4 experts: other experts, still k distinct ones
        return out

    monkeypatch.setattr(JaxSampler, "generate", shifted)
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            *QWEN3_MOE,
            f"run.run_dir={tmp_path}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "reward.functions=[{fn: tests.reward_plugins:char_count, weight: 0.01}]",
            "train.steps=2",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
            "rollout.sampler=jax",
            f"rl.router_replay={mode}",
        ],
        schema=PostTrainConfig,
    )
    fit(cfg, GRPO)
    rows = [r for r in read_metrics(tmp_path) if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["moe/route_mismatch"] == 1.0 if mode == "off" else r["moe/route_mismatch"] > 0.5
        assert r["grad_norm"] > 0
        if mode == "replay":
            assert r["mismatch/logp_gap_mean"] > 1e-3, r["mismatch/logp_gap_mean"]
        else:
            assert r["mismatch/logp_gap_mean"] < 1e-5, r["mismatch/logp_gap_mean"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.sampler=vllm"], "needs rollout.record_routes=true"),
        (["rollout.sampler=jax", "rl.agent={max_turns: 2}"], "with rl.agent an episode's turns"),
    ],
)
def test_routing_replay_without_routes_is_refused_at_start(overrides, words):
    from core.config_loader import ConfigError
    from posttrain.onpolicy.checks import check_config

    cfg = load_config("recipes/configs/grpo_tiny.yml", [*overrides, "rl.router_replay=replay"], schema=PostTrainConfig)
    with pytest.raises(ConfigError, match=words):
        check_config(cfg)


def test_replay_on_a_dense_policy_is_refused_before_any_sampler_starts(tmp_path, arithmetic_tokenizer):
    """The recipe's policy is a dense Qwen2: replay is refused once the trainer holds it, naming the key (before, at
    the first batch, after the samplers had started and generated)."""
    from core.config_loader import ConfigError
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.run import build_sampler_run

    cfg = _run_cfg(
        "recipes/configs/grpo_tiny.yml",
        tmp_path,
        arithmetic_tokenizer,
        "rollout.sampler=jax",
        "rl.router_replay=replay",
    )
    with pytest.raises(ConfigError, match="rl.router_replay=replay, but the policy \\(family 'qwen2'\\) is dense"):
        build_sampler_run(cfg, GRPO)


def test_recording_vllms_routes_refuses_a_compiled_engine_and_a_completion_it_did_not_record():
    """`RouteRecorder` (on a stand-in for the engine's config: the check runs before any vLLM object is read)
    refuses an engine whose graph is compiled, and prefix caching; a completion it has no record of is an error,
    not routes of -1."""
    from types import SimpleNamespace

    from core.config import ModelConfig, MoeConfig
    from rollout.vllm_routes import RouteRecorder

    served = ModelConfig(family="qwen3_moe", qk_norm=True, moe=MoeConfig(num_experts=4))

    def engine(eager, prefix):
        config = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=eager),
            cache_config=SimpleNamespace(enable_prefix_caching=prefix),
        )
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))

    with pytest.raises(ValueError, match="needs rollout.enforce_eager=true"):
        RouteRecorder(engine(False, False), served)
    with pytest.raises(ValueError, match="prefix caching off"):
        RouteRecorder(engine(True, True), served)
    recorder = RouteRecorder.__new__(RouteRecorder)
    recorder._keys, recorder._routes, recorder._step, recorder.k = {}, {}, [None, None], 2
    with pytest.raises(RuntimeError, match="no routes were recorded for completion 1 of vLLM request '7'"):
        recorder.take("7", 1, 5)


@pytest.mark.integration
@pytest.mark.serial
def test_async_grpo_replays_vllms_routes_and_resumes_on_them_exactly(tmp_path, arithmetic_tokenizer):
    """GRPO on a Qwen3-MoE policy with the vLLM sampler on Ray recording its routes (`rollout.record_routes`),
    routing replay on, async (`rl.off_policy_steps=1`). The trainer trains on vLLM's experts: in float32, on the
    first step's completions (sampled by the policy it holds) its own router picks the experts vLLM picked
    (`moe/route_mismatch`, over the routed tokens) and its log-probs are the sampler's. Checkpoint 2 stores the
    completions in flight with their routes; with the last checkpoint removed, the same config resumes from it
    and step 3 trains on them: it logs what it logged the first time (replay refuses a batch without routes, so
    lost routes would fail the step)."""
    import shutil

    import ray

    from posttrain.fit import fit
    from posttrain.grpo import GRPO
    from rollout.ray import ensure_ray

    cfg = _run_cfg(
        "recipes/configs/grpo_tiny.yml",
        tmp_path,
        arithmetic_tokenizer,
        *QWEN3_MOE,
        "reward.functions=[{fn: tests.reward_plugins:char_count, weight: 0.01}]",
        "rollout.sampler=vllm",
        "rollout.record_routes=true",
        "rl.router_replay=replay",
        "rl.off_policy_steps=1",
        "train.steps=3",
        "checkpoint.every_steps=2",
        "checkpoint.export_hf=false",
    )
    ensure_ray(num_cpus=2)
    try:
        fit(cfg, GRPO)
        first = [r for r in read_metrics(tmp_path) if "reward/mean" in r]
        shutil.rmtree(tmp_path / "checkpoints" / "3")
        fit(cfg, GRPO)
    finally:
        ray.shutdown()
    rows = [r for r in read_metrics(tmp_path) if "reward/mean" in r]
    assert [r["step"] for r in first] == [1, 2, 3] and [r["step"] for r in rows] == [1, 2, 3]  # step 3 redone
    assert max(r["staleness_max"] for r in first) == 1  # async: step 3's completions were in flight at checkpoint 2
    assert all("moe/route_mismatch" in r and r["grad_norm"] > 0 for r in first)  # every batch came with routes
    # Step 1's completions come from the policy the trainer holds: the same experts, the same log-probs (measured:
    # mismatch 0, gap 7e-7). Later ones are a version old (async), so both move a little (measured 0.5-1.3% of
    # (token, layer) pairs and a 0.02 gap after one update at lr 1e-4): the drift replay trains through.
    assert first[0]["staleness_max"] == 0
    assert first[0]["moe/route_mismatch"] < 0.02, first[0]["moe/route_mismatch"]  # a near-tie may flip one
    assert first[0]["mismatch/logp_gap_mean"] < 1e-4, first[0]["mismatch/logp_gap_mean"]
    for key in ("loss", "reward/mean", "moe/load_balance_loss", "mismatch/logp_gap_mean", "policy_version"):
        assert rows[2][key] == pytest.approx(first[2][key], abs=1e-6), key
