"""The advantage estimators `rl.advantage.estimator` names and GDPO's `rl.advantage.aggregation`: against TRL's own
code where TRL has them (its group normalisation and `normalize_then_sum`; tests/fixtures/trl_rl_objectives.json),
REINFORCE++ against NumPy written from its definition (the batch's token-weighted mean and std), the failed and
flat groups, and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.advantages import group_advantages, normalized_advantages
from posttrain.config import PostTrainConfig

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "trl_rl_objectives.json").read_text())


@pytest.mark.parametrize("case", FIXTURE["advantage_cases"], ids=lambda c: f"{c['aggregation']}-{c['weights']}")
def test_sum_then_normalize_and_gdpo_match_trls_code(case):
    rewards, w, g = np.asarray(case["rewards"]), np.asarray(case["weights"]), case["generations"]
    if case["aggregation"] == "sum_then_normalize":
        adv = group_advantages((rewards * w).sum(-1), g, "group_norm", 1e-4)
    else:
        adv = normalized_advantages(
            {"correct": rewards[:, 0], "length": rewards[:, 1]}, dict(zip(["correct", "length"], w)), g
        )
        assert set(adv.normalized) == {
            f"reward/{k}/normalized_{s}" for k in ("correct", "length") for s in ("mean", "std")
        }
        assert abs(adv.normalized["reward/correct/normalized_mean"]) < 1e-9  # each group's mean is 0 after it
    np.testing.assert_allclose(adv.values, np.asarray(case["advantages"]), atol=2e-6)
    assert adv.zero_variance_groups == 1 and not adv.keep[12:16].any()  # group 3 is flat in both rewards


def test_gdpo_keeps_a_narrow_reward_from_drowning():
    """With equal weights, summing first lets the length score (hundreds) decide every advantage; normalising each
    reward first gives correctness its share."""
    cases = {(c["aggregation"], tuple(c["weights"])): np.asarray(c["advantages"]) for c in FIXTURE["advantage_cases"]}
    rewards = np.asarray(FIXTURE["advantage_cases"][0]["rewards"])
    correct = rewards[:, 0]

    def tracks_correctness(adv):  # the correlation of the advantages with correctness, over the varied groups
        return np.corrcoef(adv[:12], correct[:12])[0, 1]

    assert tracks_correctness(cases[("sum_then_normalize", (1.0, 1.0))]) < 0.5
    assert (
        tracks_correctness(cases[("normalize_then_sum", (1.0, 1.0))])
        > tracks_correctness(cases[("sum_then_normalize", (1.0, 1.0))]) + 0.2
    )


def np_whiten(x, tokens):
    """The batch's mean and std, each completion weighted by its tokens (Bessel over tokens), eps 1e-4."""
    w = np.asarray(tokens, float)
    mean = (w * x).sum() / w.sum()
    std = np.sqrt((w * (x - mean) ** 2).sum() / (w.sum() - 1))
    return (x - mean) / (std + 1e-4)


def test_reinforce_pp_whitens_over_the_batchs_tokens():
    rng = np.random.default_rng(3)
    rewards = rng.integers(0, 3, 16).astype(float)
    rewards[4:8] = 2.0  # a flat group: REINFORCE++ without a baseline still has a signal for it
    rewards[9] = np.nan  # group 2 failed: dropped whole, out of the batch's statistics
    tokens = rng.integers(3, 40, 16)
    ok = np.repeat([True, True, False, True], 4)
    adv = group_advantages(rewards, 4, "reinforce_pp", tokens=tokens)
    expected = np_whiten(rewards[ok], tokens[ok])
    np.testing.assert_allclose(adv.values[ok], expected, rtol=1e-5)
    assert (adv.values[~ok] == 0).all() and not adv.trainable[~ok].any() and adv.failed_groups == 1
    assert adv.keep[4:8].all() and np.abs(adv.values[4:8]).min() > 0  # the flat group trains
    assert not adv.signal[4:8].any()  # but dynamic sampling sees no variance in it
    # Token weights matter: the sequence-weighted statistics differ.
    assert not np.allclose(expected, np_whiten(rewards[ok], np.ones(ok.sum())))

    base = group_advantages(rewards, 4, "reinforce_pp_baseline", tokens=tokens)
    centred = (rewards - np.repeat(np.nanmean(rewards.reshape(4, 4), 1), 4))[ok]
    varied = np.repeat([True, False, True], 4)  # of the groups that did not fail, the flat one is 0 and masked
    np.testing.assert_allclose(base.values[ok][varied], np_whiten(centred, tokens[ok])[varied], rtol=1e-5)
    assert (base.values[4:8] == 0).all() and not base.keep[4:8].any()


def test_gdpo_drops_a_group_with_a_failed_reward_from_every_statistic():
    rng = np.random.default_rng(5)
    values = {"a": rng.normal(size=12), "b": rng.normal(size=12) * 50}
    values["b"][2] = np.nan
    adv = normalized_advantages(values, {"a": 1.0, "b": 1.0}, 4)
    assert adv.failed_groups == 1 and (adv.values[:4] == 0).all() and not adv.trainable[:4].any()
    rest = normalized_advantages({k: v[4:] for k, v in values.items()}, {"a": 1.0, "b": 1.0}, 4)
    np.testing.assert_allclose(adv.values[4:], rest.values, rtol=1e-6)  # as if the failed group were not there


def test_the_config_chooses_the_estimator_and_its_token_weights():
    """`step_advantages` (GRPO's and on-policy distillation's) reads `rl.advantage` and weighs each completion by
    the tokens it trains (a multi-turn episode's sampled ones)."""
    from posttrain.onpolicy.policy_gradient import step_advantages
    from rewards.runner import RewardBatch
    from rollout.sampler import Completion

    rng = np.random.default_rng(7)
    total = rng.normal(size=8).astype(np.float32)
    lengths = rng.integers(2, 9, 8)
    completions = [Completion([1], [5] * int(n), None, "stop", "") for n in lengths]
    completions[0].sampled = [True, False] + [True] * (int(lengths[0]) - 2)  # an episode: one token is the env's
    tokens = lengths.copy()
    tokens[0] -= 1
    rewards = RewardBatch(total, {"f": total}, {"f": np.zeros(8, bool)})
    cfg = _cfg("rl.advantage.estimator=reinforce_pp")
    got = step_advantages(cfg, rewards, completions).values
    np.testing.assert_allclose(got, group_advantages(total, 4, "reinforce_pp", tokens=tokens).values, rtol=1e-6)
    assert not np.allclose(got, group_advantages(total, 4, "reinforce_pp", tokens=lengths).values)


def _cfg(*overrides: str) -> PostTrainConfig:
    return load_config("recipes/configs/grpo_tiny.yml", list(overrides), schema=PostTrainConfig)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rl.advantage.estimator=reinforce"], "unknown rl.advantage.estimator 'reinforce'; known: group_norm, drgrpo"),
        (["rl.advantage.aggregation=normalize_then_sum", "rl.advantage.estimator=rloo"],
         "rl.advantage.estimator=rloo would not be used"),
        (["rl.advantage.aggregation=sum_first"], "rl.advantage.aggregation"),
    ],
)  # fmt: skip
def test_bad_estimators_and_aggregations_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert message in str(err.value)
