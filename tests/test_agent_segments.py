"""An agent that rewrote its history through the endpoint made an episode of several segments (`rollout.recording`):
the episode is its last reply's trajectory with the others as `Episode.earlier`; GRPO trains every segment with the
episode's advantage, in the episode's packing group, and Dr.GRPO's step size does not change with them; a method
that trains one trajectory per episode fails such an episode, named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.test_agent_program import _cfg, _program_episodes


def test_an_episode_whose_agent_rewrote_its_history_is_its_segments(tmp_path):
    """`rewrites` makes a second call that does not extend its first (a summary of the history): the episode is two
    trajectories, the second (the last reply's) its own and the first in `earlier`, each the tokens of its call, the
    episode's calls counted across both. A method that trains one trajectory per episode (PPO, on-policy
    distillation) fails such an episode, named; a checkpoint keeps the earlier segments."""
    import json

    from rollout.episodes import Episode

    rows = [{"question": "What is 1 + 1?"}]
    episodes = _program_episodes(tmp_path, "rewrites", rows, 2)
    for e in episodes:
        assert e.finish == "done" and e.turns == 2 and e.rewards == [1.0], (e.finish, e.error)
        (first,) = e.earlier
        assert sum(first.sampled) > 0 and sum(e.sampled) > 0
        assert first.prompt_ids != e.prompt_ids  # the rewritten history's rendering, not a continuation
        again = Episode.from_record(json.loads(json.dumps(e.record())))  # as a checkpoint stores it
        assert again.earlier == e.earlier and again.token_ids == e.token_ids
    one = _program_episodes(tmp_path, "rewrites", rows, 2, segments=False)
    assert all(e.finish == "failed" and "formed 2 segments" in e.error and not e.earlier for e in one)
    # the episode's own trajectory is the one its last reply went to, not the last to start
    (back,) = _program_episodes(tmp_path, "returns_to_first", rows, 1)
    (summary,) = back.earlier
    assert back.turns == 3 and back.finish == "done" and "Earlier you answered" in _decode(tmp_path, summary.prompt_ids)
    assert "Go on." in _decode(tmp_path, back.token_ids) and "Earlier" not in _decode(tmp_path, back.prompt_ids)


def _decode(tmp_path, ids) -> str:
    from core.data import load_tokenizer

    return load_tokenizer(str(tmp_path / "tokenizer")).decode(ids)


def test_an_episodes_policy_version_is_its_oldest_segments():
    """What staleness is checked on: a segment sampled on an older policy makes the episode that old."""
    from types import SimpleNamespace

    from posttrain.onpolicy.program import ProgramRollouts
    from rollout.recording import Segment

    old = Segment([], "", [1, 2], [3], [True], [-1.0], policy_version=3, replied=1)
    new = Segment([], "", [1, 4], [5], [True], [-1.0], policy_version=5, replied=2)
    rollouts = SimpleNamespace(has_functions=True, segments=True)
    e = ProgramRollouts._episode(rollouts, {}, [old, new], 1.0, None)  # type: ignore[arg-type]
    assert e.policy_version == 3 and e.prompt_ids == [1, 4] and e.earlier[0].prompt_ids == [1, 2]


def test_grpo_trains_every_segment_of_a_program_episode(tmp_path):
    """GRPO's batch of `rewrites` episodes (two segments each): every segment of every episode is a sequence of the
    batch, every model token of each a target, each with its episode's advantage; the step reports them
    (`sequences`). A GRPO that dropped the earlier segments would train half of them."""
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.method import SampleContext
    from posttrain.onpolicy.step import Scored
    from rewards.runner import RewardBatch

    rows = [{"question": "What is 1 + 1?"}, {"question": "What is 2 + 2?"}]
    episodes = _program_episodes(tmp_path, "rewrites", rows, 4)
    cfg = _cfg(tmp_path, "rewrites")
    completions = [e.completion() for e in episodes]
    rewards = RewardBatch.empty(8).plus("agent", np.arange(8, dtype=np.float32), np.zeros(8, bool), [])
    scored = Scored(rows, completions, rewards, None, episodes)
    data = GRPO.from_samples(cfg, scored, SampleContext(1, 256, 1, None, lambda: scored))
    targets = np.asarray(data.batch.packed.target_mask).sum()
    assert targets == sum(sum(c.sampled) for e in episodes for c in [*e.earlier, e.completion()])
    assert data.metrics["sequences"] == 16.0 and np.asarray(data.batch.loss_mask).sum() == targets
    # sequence 2i is episode i's earlier segment, 2i + 1 the episode's own: both carry its advantage, which differs
    # between a group's episodes (their rewards do)
    mask, adv = np.asarray(data.batch.loss_mask), np.asarray(data.batch.advantages)
    per_sequence = [float(adv[r][mask[r] > 0][0]) for r in range(16)]
    assert all(np.all(adv[r][mask[r] > 0] == per_sequence[r]) for r in range(16))
    assert per_sequence[0::2] == per_sequence[1::2] and len(set(per_sequence[0:8:2])) == 4, per_sequence


def test_an_episodes_segments_train_with_its_advantage_in_its_packing_group():
    """`with_segments` and the batch it makes: episode 1's earlier segments go just before it, in its packing group,
    with its advantage and flags; the groups are padded with empty sequences to one count (its trajectories times a
    power of two); every model token of every segment is a loss token with the episode's advantage, and a failed
    episode's segments none. Without earlier segments the lists come back as they were."""
    import jax.numpy as jnp

    from core.config_loader import load_config
    from posttrain.advantages import Advantages
    from posttrain.config import PostTrainConfig
    from posttrain.losses.policy import policy_loss
    from posttrain.onpolicy.policy_gradient import loss_settings, mini_batch, rl_batch
    from posttrain.onpolicy.rl_batch import with_segments
    from rollout.sampler import Completion

    def traj(k: int) -> Completion:  # prompt k, then a model token, an environment's, a model token
        return Completion([k, k + 1], [k + 2, 9, k + 3], [-1.0] * 3, "stop", "", sampled=[True, False, True])

    c = [traj(10 * i) for i in range(4)]
    earlier = [[], [traj(50), traj(60)], [], [traj(70)]]
    values = np.array([1.0, -2.0, 3.0, -4.0], np.float32)
    keep = np.array([True, True, True, False])
    out, adv, (flags,) = with_segments(c, earlier, values, [keep], groups=2)
    assert len(out) == 8  # group 0 holds 4 sequences, group 1 holds 3: both padded to 2 x 2
    assert out[:4] == [c[0], earlier[1][0], earlier[1][1], c[1]]
    assert out[4:7] == [c[2], earlier[3][0], c[3]] and out[7].token_ids == [] and out[7].prompt_ids == [0]
    assert adv.tolist() == [1.0, -2.0, -2.0, -2.0, 3.0, -4.0, -4.0, 0.0]
    assert flags.tolist() == [True, True, True, True, True, False, False, False]
    same, same_adv, (same_keep,) = with_segments(c, [[]] * 4, values, [keep], groups=2)
    assert same == c and same_adv.tolist() == values.tolist() and same_keep.tolist() == keep.tolist()

    overrides = ["rl.batch.mini_batches=2", "rl.batch.prompts_per_step=2", "rl.batch.num_generations=2"]
    cfg = load_config("recipes/configs/grpo_tiny.yml", overrides, schema=PostTrainConfig)
    batch = rl_batch(cfg, c, Advantages(values, keep, keep, 0, 0), row_len=64, row_multiple=1, earlier=earlier)
    mask, token_adv = np.asarray(batch.loss_mask), np.asarray(batch.advantages)
    assert mask.shape[0] == 8 and mask.sum(axis=1).tolist() == [2, 2, 2, 2, 2, 0, 0, 0]
    assert (token_adv * mask).sum(axis=1).tolist() == [2.0, -4.0, -4.0, -4.0, 6.0, 0.0, 0.0, 0.0]
    first = mini_batch(batch, 0, 2)  # mini-batch 0 is episode 0 and 1's four sequences, whole
    assert np.asarray(first.loss_mask).sum() == 8 and np.asarray(first.packed.target_ids)[1, 0] == 52
    # Dr.GRPO divides by the micro-batch's episodes (2), not its sequences (4): the segments leave its step size
    settings = dataclasses.replace(loss_settings(cfg), loss_agg="sequence-mean-token-sum-norm")
    assert settings.sequences == 2
    plain = mini_batch(rl_batch(cfg, c, Advantages(values, keep, keep, 0, 0), row_len=64, row_multiple=1), 0, 2)
    norms = []
    for m in (first, plain):
        mask, logp = jnp.asarray(m.loss_mask), jnp.full(m.loss_mask.shape, -1.0)
        norms.append(float(policy_loss(logp, logp, jnp.asarray(m.advantages), mask, settings, logp)[1]))
    assert norms == [2.0 * settings.max_tokens] * 2 and plain.loss_mask.shape[0] == 2
    odd = dataclasses.replace(settings, sequences=3)
    with pytest.raises(ValueError, match="Dr.GRPO's 3 episodes a micro-batch do not divide its 4 sequences"):
        policy_loss(jnp.zeros((4, 1)), jnp.zeros((4, 1)), jnp.zeros((4, 1)), jnp.ones((4, 1)), odd, jnp.zeros((4, 1)))
