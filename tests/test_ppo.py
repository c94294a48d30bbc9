"""PPO with a critic: GAE, the clipped value loss and the whole objective (fed by transformers' outputs) against
NumPy references written from their definitions, the critic's learning rate and warm-up on a real step, and the
exported critic against transformers' own token-classification model."""

from __future__ import annotations

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig
from posttrain.ppo import gae, last_token_rewards, value_loss, whiten

PPO_TINY = "recipes/configs/ppo_tiny.yml"


def gae_reference(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al., 2016) by its definition, row by row over the listed steps: the episode ends after
    the last one (the next value is 0)."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[b, steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv, (adv + values) * mask


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_its_definition_with_masks_and_episode_ends(gamma, lam):
    """Rows of different lengths (their episodes end there), holes where an environment wrote tokens (not steps:
    skipped), a row with no step at all; per-token rewards anywhere."""
    rng = np.random.default_rng(0)
    b, t = 6, 9
    lengths = [9, 5, 1, 0, 7, 3]
    mask = np.array([[j < n for j in range(t)] for n in lengths])
    mask[4, 2:4] = False  # an environment's tokens inside the episode
    rewards = rng.normal(size=(b, t)) * mask
    values = rng.normal(size=(b, t)) * mask
    adv, ret = (np.asarray(x) for x in gae(rewards, values, mask, gamma, lam))
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
    assert np.abs(adv[4, 1] - ref_adv[4, 1]) < 1e-5 and adv[4, 2] == 0.0  # the step before the hole bootstraps past it


def test_gae_with_gamma_and_lambda_one_is_the_reward_to_go_less_the_value():
    """A terminal reward R with gamma = lambda = 1: A_t = R - V_t (Monte Carlo)."""
    values = np.array([[0.5, 0.2, 0.1, 0.0]])
    mask = np.array([[1, 1, 1, 0]], bool)
    rewards = last_token_rewards(np.array([1.0], np.float32), mask)
    assert rewards.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    adv, ret = (np.asarray(x) for x in gae(rewards, values, mask, 1.0, 1.0))
    np.testing.assert_allclose(adv, [[0.5, 0.8, 0.9, 0.0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0, 0.0]], atol=1e-6)


def test_last_token_rewards_land_on_each_rows_last_step():
    mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], bool)
    out = last_token_rewards(np.array([2.0, 3.0, -1.0], np.float32), mask)
    assert out.tolist() == [[0, 0, 0, 2.0, 0], [0] * 5, [-1.0, 0, 0, 0, 0]]


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_numpy(clip):
    rng = np.random.default_rng(1)
    values, old, returns = rng.normal(size=(3, 3, 7))
    mask = rng.random((3, 7)) > 0.3
    total, clipped = (float(x) for x in value_loss(values, old, returns, mask.astype(np.float32), clip))
    unclipped = (values - returns) ** 2
    if clip is None:
        expected, decided = 0.5 * (unclipped * mask).sum(), 0.0
    else:
        clipped_sq = (np.clip(values, old - clip, old + clip) - returns) ** 2
        expected = 0.5 * (np.maximum(unclipped, clipped_sq) * mask).sum()
        decided = float(((clipped_sq > unclipped) * mask).sum())
        assert decided > 0  # the clip decided some tokens: the branch ran
    assert total == pytest.approx(expected, rel=1e-5) and clipped == decided


def test_whiten_over_the_masked_tokens():
    x = np.array([[1.0, 2.0, 3.0, 100.0]])
    mask = np.array([[1, 1, 1, 0]], bool)
    out = whiten(x, mask)
    assert out[0, 3] == 0.0 and abs(out[0, :3].mean()) < 1e-6 and abs(out[0, :3].std() - 1.0) < 1e-5


def test_ppo_config_is_checked_before_anything_starts():
    from posttrain.ppo import PPO

    cfg = load_config(PPO_TINY, ["rl.algorithm=gspo"], schema=PostTrainConfig)
    with pytest.raises(ConfigError, match="rl.loss.loss_agg must be token-mean"):
        PPO.check(cfg)
    cfg = load_config(PPO_TINY, ["reward.functions=[]"], schema=PostTrainConfig)
    with pytest.raises(ConfigError, match="PPO needs reward.functions"):
        PPO.check(cfg)
    cfg = load_config(PPO_TINY, ["rl.batch.dynamic_sampling=true"], schema=PostTrainConfig)
    with pytest.raises(ConfigError, match="set rl.batch.dynamic_sampling=false"):
        PPO.check(cfg)
    with pytest.raises(ConfigError, match="ppo.nope"):
        load_config(PPO_TINY, ["ppo.nope=1"], schema=PostTrainConfig)


def _batch(cfg, rng, n=8):
    """A PPO batch of `n` completions of one prompt, rewards 0 or 1, as `PPO.from_samples` makes it."""
    from posttrain.onpolicy.method import SampleContext
    from posttrain.onpolicy.step import Scored
    from posttrain.ppo import PPO
    from rewards.runner import RewardBatch
    from rollout.sampler import Completion

    comps = [
        Completion([5, 6, 7], [int(x) for x in rng.integers(3, 500, 6)], list(-rng.uniform(4, 6, 6)), "stop", "")
        for _ in range(n)
    ]
    rewards = (np.arange(n) % 2).astype(np.float32)
    scored = Scored([{"question": "q"}], comps, RewardBatch(rewards, {"r": rewards}, {"r": rewards != rewards}), None)
    return PPO.from_samples(cfg, scored, SampleContext(1, 32, 1, None, more=lambda: scored)).batch


def _learner(*overrides):
    from posttrain.ppo import PPO
    from tests.helpers import method_learner

    return method_learner(PPO_TINY, PPO, "train.steps=4", *overrides)


def test_a_trainable_regex_that_leaves_a_part_untrained_is_refused_naming_it():
    with pytest.raises(ConfigError, match="leaves model with no parameter"):
        _learner("optim.trainable_regex=value_head")


def _parts(learner):
    import jax
    from flax import nnx

    tree = learner.learner.modules()
    policy = jax.tree.map(np.asarray, nnx.state(tree.model, nnx.Param))
    head = {k: np.asarray(v[...]) for k, v in nnx.state(tree.critic.value_head).items()}
    backbone = jax.tree.map(np.asarray, nnx.state(tree.critic.backbone, nnx.Param))
    return policy, head, backbone


def _largest_change(a, b):
    import jax

    return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_critic_warms_up_alone_at_its_own_learning_rate():
    """ppo.critic_warmup_steps=1, ppo.critic_learning_rate 10x optim's: step 1 moves the critic (its head by
    Adam's first step, ~its learning rate) and leaves the policy as it was; step 2 moves the policy (by ~optim's
    learning rate). The value loss starts at 0.5 * mean(R^2) (every value 0; gamma = lambda = 1: every return is
    R) and goes down; the zero-initialised head passes the gradient to the backbone from step 2."""
    learner, cfg = _learner(
        "optim.learning_rate=1.0e-3", "ppo.critic_learning_rate=1.0e-2", "ppo.critic_warmup_steps=1",
        "optim.weight_decay=0.0", "ppo.lam=1.0",
    )  # fmt: skip
    batch = _batch(cfg, np.random.default_rng(0))
    policy0, head0, _ = _parts(learner)
    first = learner.train(batch).metrics
    policy1, head1, backbone1 = _parts(learner)
    assert _largest_change(policy0, policy1) == 0.0  # the policy waits for the critic
    assert abs(float(np.abs(head1["bias"] - head0["bias"]).max()) - 1.0e-2) < 1.0e-3  # the critic's own rate
    assert float(np.abs(head1["kernel"] - head0["kernel"]).max()) > 1e-3
    mask = np.asarray(batch.loss_mask) > 0
    returns = np.where(mask, np.asarray(batch.rewards)[:, None], 0.0)  # gamma 1: every step's return is R
    expected = 0.5 * float((returns**2)[mask].mean())
    assert first["value_loss"] == pytest.approx(expected, rel=1e-4) and first["value/mean"] == 0.0
    second = learner.train(batch).metrics
    policy2, _, backbone2 = _parts(learner)
    assert 5e-4 < _largest_change(policy1, policy2) < 2e-3  # optim's learning rate, after the warm-up
    assert _largest_change(backbone1, backbone2) > 0
    assert second["value_loss"] < first["value_loss"]
    assert second["grad_norm"] > 0 and np.isfinite(second["loss"])


@pytest.mark.parametrize("sharded", [False, True])
def test_the_exported_critic_is_transformers_token_classification_model(tmp_path, monkeypatch, sharded):
    """After two steps (the head is no longer zero), the critic exported beside the policy reads in
    `transformers.AutoModelForTokenClassification` (one label) and gives the critic's values: the logit at the
    position before each completion token. Sharded (small shards): the head is a shard of its own in the index."""
    import functools

    import jax
    import torch
    from transformers import AutoModelForTokenClassification

    import core.hf.directory
    from posttrain.ppo import PPO

    if sharded:
        sharded_save = functools.partial(core.hf.directory.save_hf, max_shard_bytes=200_000)
        monkeypatch.setattr(core.hf.directory, "save_hf", sharded_save)

    learner, cfg = _learner("optim.learning_rate=1.0e-2")
    batch = _batch(cfg, np.random.default_rng(0))
    for _ in range(2):
        learner.train(batch)
    PPO.export_beside(cfg, learner.learner, tmp_path / "hf", None)
    critic = learner.learner.modules().critic
    with jax.set_mesh(learner.mesh):
        ours = np.asarray(jax.jit(lambda c, p: c.values(p))(critic, batch.packed))
    assert np.abs(ours).max() > 1e-3  # values the check can tell apart
    assert (tmp_path / "hf" / "critic" / "model.safetensors.index.json").exists() == sharded
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf" / "critic", torch_dtype=torch.float32)
    assert hf.config.num_labels == 1 and type(hf).__name__ == "Qwen2ForTokenClassification"
    packed = batch.packed
    for row in range(2):
        mask = np.asarray(packed.target_mask)[row] > 0
        tokens = [5, 6, 7] + [int(t) for t in np.asarray(packed.target_ids)[row][mask]]
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, :, 0].numpy()
        np.testing.assert_allclose(ours[row][mask], logits[2 : 2 + int(mask.sum())], rtol=1e-4, atol=1e-4)


def test_the_whole_ppo_objective_matches_numpy_on_transformers_outputs(tmp_path):
    """PPO's loss on a batch, end to end: after two updates (the policy and the critic both moved), `attach` (the
    critic's values, GAE, whitened advantages) and the compiled objective (the clipped surrogate with clip-higher,
    dual clip and TIS, plus the clipped value loss, token-mean) against a NumPy reference written from their
    definitions, fed only by transformers' outputs of the exported policy (log-probs) and critic (values). pi_old
    and V_old are moved off the current ones, so that each clip decides some tokens."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    learner, cfg = _learner("optim.learning_rate=1.0e-2", "rl.loss.dual_clip=3.0", "rl.loss.epsilon_high=0.28")
    rng = np.random.default_rng(0)
    batch = _batch(cfg, rng)
    for _ in range(2):
        assert learner.train(batch).metrics["grad_norm"] > 0
    learner.export(tmp_path / "hf", None)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf" / "critic", dtype=torch.float32)

    packed = batch.packed
    mask = np.asarray(batch.loss_mask, np.float64) > 0
    target_ids = np.asarray(packed.target_ids)
    logp, values = np.zeros(mask.shape), np.zeros(mask.shape)
    for b in range(mask.shape[0]):  # each row of the targets is one completion of the prompt [5, 6, 7]
        n = int(mask[b].sum())
        tokens = torch.tensor([[5, 6, 7, *target_ids[b][mask[b]].tolist()]])
        with torch.no_grad():
            logprobs = torch.log_softmax(policy(tokens).logits[0].double() / cfg.rollout.temperature, -1).numpy()
            v = critic(tokens).logits[0, :, 0].double().numpy()
        logp[b, mask[b]] = logprobs[np.arange(2, 2 + n), target_ids[b][mask[b]]]
        values[b, mask[b]] = v[2 : 2 + n]

    # attach: the critic's values, then GAE (gamma, lambda) on each completion's reward at its last token, whitened
    p = cfg.ppo
    rewards = np.where(mask & (np.cumsum(mask, 1) == mask.sum(1, keepdims=True)), np.asarray(batch.rewards)[:, None], 0)
    advantages, returns = gae_reference(rewards, values, mask, p.gamma, p.lam)
    assert p.whiten_advantages
    advantages = np.where(mask, (advantages - advantages[mask].mean()) / (advantages[mask].std() + 1e-8), 0.0)
    attached, _ = learner.attach(batch)
    np.testing.assert_allclose(np.asarray(attached.old_values)[mask], values[mask], atol=2e-4)
    np.testing.assert_allclose(np.asarray(attached.returns)[mask], returns[mask], atol=2e-4)
    np.testing.assert_allclose(np.asarray(attached.advantages)[mask], advantages[mask], atol=2e-3)

    # pi_old, the sampler's log-probs and V_old moved, so that the clips and the TIS cap decide
    old_logp = np.where(mask, logp + rng.uniform(-1.5, 1.0, mask.shape), 0.0)  # ratios up to e^1.5 > dual_clip
    sampler_logp = np.where(mask, old_logp - rng.uniform(0.0, 1.5, mask.shape), 0.0)  # weights up to e^1.5 > cap
    old_values = np.where(mask, values + rng.uniform(-0.5, 0.5, mask.shape), 0.0)
    moved = dataclasses.replace(
        attached,
        old_logp=old_logp.astype(np.float32),
        sampler_logp=sampler_logp.astype(np.float32),
        old_values=old_values.astype(np.float32),
    )
    out = learner.learner.evaluate(moved)

    loss = cfg.rl.loss
    adv = np.asarray(attached.advantages, np.float64)
    ratio = np.exp(logp - old_logp)
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 1 - loss.epsilon, 1 + loss.epsilon_high)
    per_token = np.maximum(unclipped, clipped)
    dual = (adv < 0) & (per_token > -adv * loss.dual_clip)
    per_token = np.where(dual, -adv * loss.dual_clip, per_token)
    cap = cfg.rl.rollout_correction.hi  # the default correction: token_truncate
    assert cfg.rl.rollout_correction.mode == "token_truncate" and cap is not None
    capped = np.exp(old_logp - sampler_logp) > cap
    per_token *= np.minimum(np.exp(old_logp - sampler_logp), cap)
    v_unclipped = (values - returns) ** 2
    v_clipped = (old_values + np.clip(values - old_values, -p.value_clip, p.value_clip) - returns) ** 2
    value_sum = 0.5 * np.maximum(v_unclipped, v_clipped)[mask].sum()
    expected = (per_token[mask].sum() + value_sum) / mask.sum()
    # each branch decides some tokens: the policy clip, the dual clip, the TIS cap, the value clip
    assert (clipped > unclipped)[mask].any() and dual[mask].any() and (v_clipped > v_unclipped)[mask].any()
    assert capped[mask].any() and not capped[mask].all()
    assert float(out.denominator) == mask.sum()
    assert float(out.total) / float(out.denominator) == pytest.approx(expected, rel=1e-4)


def _flat(module) -> dict:
    from flax import nnx

    return {".".join(map(str, path)): v[...] for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _paths(state) -> set[str]:
    from flax import nnx

    return {".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}


def test_the_critics_output_head_is_not_trained():
    """No value reads the critic's output projection (an untied `lm_head`): it gets no gradient buffer and no
    optimizer state, and stays as it started, while the policy's own head trains."""
    learner, cfg = _learner("model.tie_word_embeddings=false", "optim.learning_rate=1.0e-2")
    trained = _paths(learner.learner.params)
    assert "model.lm_head.kernel" in trained and not any(p.startswith("critic.backbone.lm_head") for p in trained)
    assert "critic.value_head.kernel" in trained and "critic.backbone.final_norm.scale" in trained
    before = np.asarray(learner.learner.modules().critic.backbone.lm_head.kernel[...])
    learner.train(_batch(cfg, np.random.default_rng(0)))
    np.testing.assert_array_equal(np.asarray(learner.learner.modules().critic.backbone.lm_head.kernel[...]), before)


def _causal_lm(path, vocab: int, hidden: int = 64, tied: bool = True):
    """A random Qwen2 causal LM of its own shape, written by transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=tied,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def test_a_critic_from_its_own_checkpoint_trains_and_exports(tmp_path):
    """`ppo.critic_init_from`: a causal LM of another shape (1 layer, width 64, untied, where the policy is 2 x 128)
    is the critic's backbone: it trains whole beside a LoRA policy (the policy's adapters; the critic's every
    parameter but its unread output head), and its export reads in transformers as a token-classification model
    whose logits are the critic's values. A path that does not exist, and a checkpoint whose vocabulary cannot hold
    the policy's token ids, are refused naming the key."""
    import jax
    import torch
    from transformers import AutoModelForTokenClassification

    from posttrain.ppo import PPO

    source = _causal_lm(tmp_path / "critic_lm", vocab=512, tied=False)
    learner, cfg = _learner(
        f"ppo.critic_init_from={source}", "model.lora={rank: 4, alpha: 8}", "optim.learning_rate=1.0e-2"
    )
    critic = learner.learner.modules().critic
    assert critic.backbone.cfg.hidden_size == 64 and critic.backbone.cfg.num_layers == 1
    trained = _paths(learner.learner.params)
    assert any(p.startswith("critic.backbone.layers") for p in trained)  # the critic's whole backbone
    assert all(p.startswith("critic.") or "lora" in p for p in trained)  # the policy's adapters alone
    assert not any(p.startswith("critic.backbone.lm_head") for p in trained)  # read by no value
    start = {k: np.asarray(v) for k, v in _flat(learner.learner.modules().critic.backbone).items()}
    batch = _batch(cfg, np.random.default_rng(0))
    for _ in range(2):
        assert learner.train(batch).metrics["value_loss"] > 0
    end = {k: np.asarray(v) for k, v in _flat(learner.learner.modules().critic.backbone).items()}
    moved = {k for k in start if not np.array_equal(start[k], end[k])}
    assert moved == set(start) - {"lm_head.kernel"}, set(start) ^ moved  # every parameter trained but the head
    PPO.export_beside(cfg, learner.learner, tmp_path / "hf", None)
    critic = learner.learner.modules().critic
    with jax.set_mesh(learner.mesh):
        ours = np.asarray(jax.jit(lambda c, p: c.values(p))(critic, batch.packed))
    assert np.abs(ours).max() > 1e-3
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf" / "critic", dtype=torch.float32)
    assert hf.config.hidden_size == 64
    mask = np.asarray(batch.packed.target_mask)[0] > 0
    tokens = [5, 6, 7] + [int(t) for t in np.asarray(batch.packed.target_ids)[0][mask]]
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, :, 0].numpy()
    np.testing.assert_allclose(ours[0][mask], logits[2 : 2 + int(mask.sum())], rtol=1e-4, atol=1e-4)

    small = _causal_lm(tmp_path / "small_vocab", vocab=256)
    with pytest.raises(ConfigError, match="ppo.critic_init_from=.*256 tokens, fewer than the policy's 512"):
        _learner(f"ppo.critic_init_from={small}")
    with pytest.raises(ConfigError, match="ppo.critic_init_from=.*no such file or directory"):
        PPO.check(load_config(PPO_TINY, [f"ppo.critic_init_from={tmp_path / 'nope'}"], schema=PostTrainConfig))
