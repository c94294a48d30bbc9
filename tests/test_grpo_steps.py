"""GRPO steps on the JAX sampler: iterations x mini-batches, dynamic sampling's refill, failed rewards dropping their
group and the non-finite loss policies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.config_loader import load_config
from posttrain.config import PostTrainConfig


def _jax_config(tmp_path, tokenizer, *overrides):
    """grpo_tiny.yml in single-controller mode (the JAX sampler), run directory under `tmp_path`."""
    return load_config(
        "recipes/configs/grpo_tiny.yml",
        [f"run.run_dir={tmp_path / 'run'}", f"data.tokenizer_dir={tokenizer}", "rollout.sampler=jax", *overrides],
        schema=PostTrainConfig,
    )


def _jax_run(tmp_path, tokenizer, *overrides, method=None):
    """A two-step run without checkpoints (`method`: a GRPO that records what it builds)."""
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.run import build_sampler_run

    cfg = _jax_config(
        tmp_path, tokenizer, "checkpoint.enabled=false", "checkpoint.export_hf=false", "train.steps=2", *overrides
    )
    return build_sampler_run(cfg, method or GRPO)


@pytest.mark.integration
def test_iterations_and_mini_batches_take_that_many_updates(tmp_path, arithmetic_tokenizer):
    run = _jax_run(
        tmp_path,
        arithmetic_tokenizer,
        "reward.functions=[{fn: tests.reward_plugins:char_count}]",
        "rl.batch.num_iterations=2",
        "rl.batch.mini_batches=2",
        "optim.learning_rate=1.0e-2",
    )
    try:
        seen = []
        run.train(on_step=lambda r, step, m: seen.append(m))
        assert int(run.trainer.local().learner.learner.state.step) == 2 * 2 * 2  # steps x iterations x mini-batches
        # Later updates of a step see a policy that already moved: pi_theta != pi_old, so ratios leave 1.
        assert any(m["clip_fraction"] > 0 for m in seen)
    finally:
        run.close()


@pytest.mark.integration
def test_another_objective_and_correction_train_in_grpo(tmp_path, arithmetic_tokenizer):
    """`rl.loss.type`, `rl.rollout_correction`, `rl.advantage.aggregation` and the entropy bonus reach GRPO's step:
    SAPO's gate with a sequence mask, an adaptive entropy bonus and GDPO's per-reward normalisation, their metrics
    logged
    (the JAX sampler in float32 gives the trainer's log-probs: no sequence is masked, every ratio is ~1)."""
    run = _jax_run(
        tmp_path,
        arithmetic_tokenizer,
        "reward.functions=[{fn: tests.reward_plugins:char_count}, {fn: tests.reward_plugins:by_prompt_length}]",
        "rl.advantage.aggregation=normalize_then_sum",
        "rl.loss.type=sapo",
        "rl.loss.entropy_coef=0.01",
        "rl.loss.entropy_target=100.0",  # above any entropy of a 512-token vocabulary: the coefficient rises
        "rl.loss.entropy_coef_range=[0.0, 0.1]",
        "rl.loss.entropy_coef_delta=0.01",
        "rl.rollout_correction={mode: sequence_mask, lo: 0.5, hi: 2.0}",
        "rl.batch.num_iterations=2",
    )
    try:
        seen = []
        run.train(on_step=lambda r, step, m: seen.append(m))
        assert len(seen) == 2 and all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in seen)
        # adaptive entropy control: nothing measured before step 1 (no bonus), then raised by its delta
        assert [m["entropy_coef"] for m in seen] == pytest.approx([0.0, 0.02])
        assert [m["entropy_control/coef"] for m in seen] == pytest.approx([0.01, 0.02])
        for m in seen:
            assert m["correction/masked_sequences"] == 0.0 and m["correction/masked_tokens"] == 0.0
            assert abs(m["correction/ratio_min"] - 1) < 1e-2 and abs(m["correction/ratio_max"] - 1) < 1e-2
            assert m["clip_fraction"] == 0.0  # SAPO's gate cuts no token off
            assert {"reward/char_count/normalized_std", "reward/by_prompt_length/normalized_mean"} <= set(m)
            assert m["entropy"] > 0
    finally:
        run.close()


@pytest.mark.integration
@pytest.mark.parametrize(
    "loss,region,estimator,reward",
    [
        # REINFORCE++ whitens over the batch: groups without reward variance (every group here) still train
        ("cispo", "rl.loss.cispo_cap=1.001", "reinforce_pp", "by_prompt_length"),
        ("gmpo", "rl.loss.epsilon=0.001", "reinforce_pp_baseline", "char_count"),
        ("dppo", "rl.loss.dppo_delta=1.0e-4", "rloo", "char_count"),
    ],
)
def test_each_objective_and_estimator_trains_a_grpo_run(
    tmp_path, arithmetic_tokenizer, loss, region, estimator, reward
):
    """CISPO, GMPO and DPPO each train a GRPO run (two steps of two updates at a high learning rate, the second
    update off-policy), with REINFORCE++ (with and without the group baseline) and RLOO advantages. Each trust
    region, narrowed, acts on some tokens but not all."""
    run = _jax_run(
        tmp_path,
        arithmetic_tokenizer,
        f"reward.functions=[{{fn: tests.reward_plugins:{reward}}}]",
        f"rl.loss.type={loss}",
        region,
        f"rl.advantage.estimator={estimator}",
        "rl.batch.num_iterations=2",
        "optim.learning_rate=1.0e-2",
    )
    try:
        seen = []
        run.train(on_step=lambda r, step, m: seen.append(m))
    finally:
        run.close()
    assert len(seen) == 2 and all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in seen)
    assert any(0 < m["clip_fraction"] < 1 for m in seen), [m["clip_fraction"] for m in seen]
    if reward == "by_prompt_length":  # every group flat: group-normalised advantages would give no gradient at all
        assert all(m["zero_variance_groups"] == 4 for m in seen)


@pytest.mark.integration
def test_dynamic_sampling_refills_until_the_round_limit(tmp_path, arithmetic_tokenizer):
    run = _jax_run(
        tmp_path,
        arithmetic_tokenizer,
        "reward.functions=[{fn: tests.reward_plugins:by_prompt_length}]",
        "rl.batch.dynamic_sampling=true",
        "rl.batch.max_sampling_rounds=3",
    )
    try:
        seen = []
        run.train(on_step=lambda r, step, m: seen.append(m))
        # No group ever has reward variance: every step draws the maximum rounds, then trains on what it has.
        assert [m["sampling_rounds"] for m in seen] == [3.0, 3.0]
        assert all(m["zero_variance_groups"] == 4 for m in seen)
    finally:
        run.close()


@pytest.mark.integration
def test_failed_reward_items_drop_their_group_from_the_trainers_batch(tmp_path, arithmetic_tokenizer):
    """A reward function that fails on a group's items: that group has no policy or KL token in the batch the
    trainer gets, and the step counts it (reward/failed_groups); the other groups train."""
    from posttrain.grpo import GRPOMethod

    batches = []

    class Recording(GRPOMethod):
        def from_samples(self, cfg, scored, ctx):
            data = super().from_samples(cfg, scored, ctx)
            batches.append(data.batch)
            return data

    run = _jax_run(
        tmp_path,
        arithmetic_tokenizer,
        "rl.loss.beta=0.05",
        "reward.functions=[{fn: tests.reward_plugins:fails_on_first_prompt}]",
        "rl.accuracy_fn=tests.reward_plugins:char_count",
        method=Recording(),
    )
    cfg = run.cfg
    try:
        seen = []
        run.train(on_step=lambda r, step, m: seen.append(m))
    finally:
        run.close()
    assert (tmp_path / "run" / "config.yaml").is_file()  # the resolved config, as pretraining writes it
    g = cfg.rl.batch.num_generations
    for batch, m in zip(batches, seen):
        assert m["reward/failed_groups"] == 1 and m["reward/failure_rate"] == g / len(batch.advantages)
        assert not batch.loss_mask[:g].any() and not batch.kl_mask[:g].any()
        assert batch.packed.target_mask[:g].any() and batch.loss_mask[g:].any() and batch.kl_mask[g:].any()
        assert not batch.advantages[:g].any() and batch.advantages[g:].any() and np.isfinite(m["loss"])


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["skip", "abort"])
def test_a_non_finite_loss_follows_nan_policy(policy, tmp_path, arithmetic_tokenizer, capsys):
    """An injected NaN at step 2. skip: the update is not applied (parameters after step 2 == after step 1),
    it is counted, the run goes on. abort: the run stops with a message naming the checkpoint it wrote, and
    the same config resumes after the bad batch."""
    import jax

    from core.learner import NonFiniteLoss
    from posttrain.grpo import GRPOMethod
    from posttrain.onpolicy.run import build_sampler_run

    class NaNAtStep2(GRPOMethod):
        calls = 0

        def from_samples(self, cfg, scored, ctx):
            data = super().from_samples(cfg, scored, ctx)
            NaNAtStep2.calls += 1
            if NaNAtStep2.calls == 2:
                data.batch.advantages[:] = np.nan
            return data

    cfg = _jax_config(
        tmp_path,
        arithmetic_tokenizer,
        "checkpoint.every_steps=1",
        "checkpoint.keep=3",
        "checkpoint.export_hf=false",
        "train.steps=3",
        f"train.nan_policy={policy}",
        "reward.functions=[{fn: tests.reward_plugins:char_count}]",
        "optim.learning_rate=1.0e-2",
    )
    params, seen = {}, {}

    def record(run, step, metrics):
        params[step] = jax.tree.map(np.asarray, run.trainer.local().learner.learner.params)
        seen[step] = metrics

    run = build_sampler_run(cfg, NaNAtStep2())
    try:
        if policy == "skip":
            run.train(on_step=record)
        else:
            with pytest.raises(NonFiniteLoss) as err:
                run.train(on_step=record)
    finally:
        run.close()
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    if policy == "skip":
        assert [seen[s]["skipped_updates"] for s in (1, 2, 3)] == [0, 1, 1]
        assert same(params[1], params[2]) and not same(params[2], params[3])
        return
    message = str(err.value)
    assert "GRPO step 2, update 1 of 1" in message and "is not finite" in message
    assert f"Checkpoint {tmp_path / 'run' / 'checkpoints' / '2'}" in message and "train.nan_policy=skip" in message
    assert sorted(seen) == [1]  # step 2 never completed
    # The same command resumes past the bad batch (here skipping a NaN at its first step: the message names the
    # run's step 3, not the policy version's next, 2, which lags after the aborted update).
    NaNAtStep2.calls = 1
    skip = cfg.model_copy(update={"train": cfg.train.model_copy(update={"nan_policy": "skip"})})
    again = build_sampler_run(skip, NaNAtStep2())
    try:
        assert again.start_step == 2
        resumed = jax.tree.map(np.asarray, again.trainer.local().learner.learner.params)
        assert same(resumed, params[1])  # the NaN update was never applied
        capsys.readouterr()
        again.train()
    finally:
        again.close()
    out = capsys.readouterr().out
    assert "GRPO step 3, update 1 of 1" in out and "GRPO step 2" not in out
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 3]  # step 2 was the bad batch: nothing logged for it, nothing doubled
