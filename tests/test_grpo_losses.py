"""GRPO/GSPO losses and advantages against small NumPy references written from the papers' formulas."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.advantages import group_advantages
from posttrain.losses import PolicyLossSettings, kl_penalty, policy_loss

AGGS = ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"]


# ------------------------------------------------------------ NumPy references


def np_advantages(rewards, g, estimator, floor=1e-6):
    out, keep, flat_groups = [], [], 0
    for start in range(0, len(rewards), g):
        grp = [float(x) for x in rewards[start:start + g]]
        mean = sum(grp) / g
        flat = all(x == grp[0] for x in grp)
        flat_groups += flat
        for i, x in enumerate(grp):
            if flat:
                a = 0.0
            elif estimator == "group_norm":
                std = (sum((y - mean) ** 2 for y in grp) / (g - 1)) ** 0.5
                a = (x - mean) / max(std, floor)
            elif estimator == "drgrpo":
                a = x - mean
            else:  # rloo: baseline = mean of the others
                a = x - (sum(grp) - x) / (g - 1)
            out.append(a)
            keep.append(not flat)
    return np.array(out), np.array(keep), flat_groups


def np_policy_loss(logp, old, adv, mask, s: PolicyLossSettings, sampler=None, ref=None):
    """Loss value and d loss / d logp, token by token."""
    B, T = logp.shape
    per = np.zeros((B, T))
    dper = np.zeros((B, T))  # derivative of each token's policy term w.r.t. the ratio's log (GSPO: the sequence's)
    dkl = np.zeros((B, T))  # derivative of each token's KL term w.r.t. its own logp
    high = s.epsilon if s.epsilon_high is None else s.epsilon_high
    for i in range(B):
        n = mask[i].sum()
        seq_ratio = np.exp(sum(mask[i, t] * (logp[i, t] - old[i, t]) for t in range(T)) / max(n, 1))
        for t in range(T):
            r = np.exp(logp[i, t] - old[i, t]) if s.algorithm == "grpo" else seq_ratio
            a = adv[i]
            objective = min(r * a, min(max(r, 1 - s.epsilon), 1 + high) * a)
            loss = -objective
            clipped = (r * a) > (min(max(r, 1 - s.epsilon), 1 + high) * a)
            d = 0.0 if clipped else -a * r
            if s.dual_clip is not None and a < 0 and -a * s.dual_clip < loss:
                loss, d = -a * s.dual_clip, 0.0
            if s.tis_cap is not None and sampler is not None:
                if s.algorithm == "grpo":
                    w = min(np.exp(old[i, t] - sampler[i, t]), s.tis_cap)
                else:  # geometric mean over the sequence's tokens
                    w = min(np.exp(sum(mask[i, u] * (old[i, u] - sampler[i, u]) for u in range(T)) / max(n, 1)),
                            s.tis_cap)
                loss, d = loss * w, d * w
            if s.beta > 0:
                x = logp[i, t] - ref[i, t]
                kl, dk = {"k1": (x, 1.0), "k2": (0.5 * x * x, x), "k3": (np.exp(-x) + x - 1, 1 - np.exp(-x))}[
                    s.kl_estimator]
                loss, dkl[i, t] = loss + s.beta * kl, s.beta * dk
            per[i, t], dper[i, t] = loss, d
    lengths = mask.sum(1)
    sequences = (lengths > 0).sum()
    if s.loss_agg == "token-mean":
        weight = mask / mask.sum()
    elif s.loss_agg == "sequence-mean-token-mean":
        weight = mask / np.maximum(lengths, 1)[:, None] / sequences
    else:
        weight = mask / s.max_tokens / sequences
    value = (per * weight).sum()
    if s.algorithm == "grpo":
        grad = (dper + dkl) * weight
    else:  # d/dlogp_t of sum_t' w_t' loss(s): the sequence ratio depends on every token, d s / d logp_t = s m_t / n
        grad = np.zeros_like(per)
        for i in range(B):
            n = max(mask[i].sum(), 1)
            total = sum(weight[i, t] * dper[i, t] for t in range(T))
            grad[i] = total * mask[i] / n + dkl[i] * weight[i]
    return value, grad


def _data(seed, B=6, T=7, spread=0.3):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (B, T))
    old = logp + rng.normal(0, spread, (B, T))
    sampler = old + rng.normal(0, 0.2, (B, T))
    ref = logp + rng.normal(0, 0.3, (B, T))
    adv = rng.normal(0, 1.0, B)
    lengths = rng.integers(1, T + 1, B)  # unequal completion lengths
    lengths[-1] = 0  # a sequence with no counted tokens (a masked group)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    return logp, old, sampler, ref, adv, mask


def _jax_loss(logp, old, adv, mask, s, sampler=None, ref=None):
    def total(lp):
        loss_sum, sums = policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), s,
                                     None if sampler is None else jnp.asarray(sampler),
                                     None if ref is None else jnp.asarray(ref))
        return loss_sum / sums["loss_denominator"], sums

    (value, sums), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(logp, jnp.float32))
    return float(value), np.asarray(grad), sums


# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("estimator", ["group_norm", "drgrpo", "rloo"])
def test_advantages_match_numpy(estimator):
    rng = np.random.default_rng(0)
    rewards = np.concatenate([
        rng.normal(size=4),                 # ordinary group
        [1.0, 1.0, 1.0, 1.0],               # std = 0: masked out
        [0.0, 0.0, 1.0, 0.0],               # binary rewards
        [-2.0, -2.0, -2.0, -2.0],           # another flat group
        [3.0, 3.0 + 1e-9, 3.0, 3.0],        # tiny std: the floor keeps it finite
    ])
    adv = group_advantages(rewards, 4, estimator, std_floor=1e-6)
    ref, keep, flat = np_advantages(rewards, 4, estimator, floor=1e-6)
    np.testing.assert_allclose(adv.values, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(adv.keep, keep)
    assert adv.zero_variance_groups == flat == 2
    assert np.isfinite(adv.values).all()


def test_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(np.zeros(6), 4)


CASES = [
    PolicyLossSettings(algorithm=algo, loss_agg=agg, epsilon=0.2, epsilon_high=high, dual_clip=dual,
                       tis_cap=tis, beta=beta, kl_estimator=est, max_tokens=9)
    for algo, agg, (high, dual, tis, beta, est) in itertools.product(
        ["grpo", "gspo"], AGGS,
        [(None, None, None, 0.0, "k3"), (0.28, 3.0, 2.0, 0.0, "k3"), (None, None, 1.5, 0.05, "k1"),
         (0.3, None, None, 0.1, "k2"), (None, 1.5, None, 0.02, "k3")])
]


@pytest.mark.parametrize("s", CASES, ids=lambda s: f"{s.algorithm}-{s.loss_agg}-{s.dual_clip}-{s.tis_cap}-{s.beta}")
def test_policy_loss_and_gradient_match_numpy(s):
    logp, old, sampler, ref, adv, mask = _data(1)
    value, grad, _ = _jax_loss(logp, old, adv, mask, s, sampler, ref)
    ref_value, ref_grad = np_policy_loss(logp, old, adv, mask, s, sampler, ref)
    assert value == pytest.approx(ref_value, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6)


def test_clipping_actually_happens_in_the_test_data():
    logp, old, sampler, ref, adv, mask = _data(1)
    _, _, sums = _jax_loss(logp, old, adv, mask, PolicyLossSettings())
    fraction = float(sums["clipped_tokens"] / sums["completion_tokens"])
    assert 0.05 < fraction < 0.95  # so the table above exercises both branches


def test_all_truncated_group_and_zero_advantages():
    # A group masked out (all-equal rewards) or all truncated with mask_truncated contributes nothing.
    logp, old, sampler, ref, adv, mask = _data(2)
    mask[:3] = 0.0
    for s in (PolicyLossSettings(loss_agg=a) for a in AGGS):
        value, grad, sums = _jax_loss(logp, old, adv, mask, s)
        ref_value, ref_grad = np_policy_loss(logp, old, adv, mask, s)
        assert value == pytest.approx(ref_value, abs=1e-6)
        np.testing.assert_allclose(grad[:3], 0.0)
    value, grad, _ = _jax_loss(logp, old, np.zeros_like(adv), mask, PolicyLossSettings())
    assert value == 0.0 and not grad.any()


def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    logp, old, _, _, adv, mask = _data(3)
    from posttrain.losses import importance_ratio

    ratio = np.asarray(importance_ratio(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), "gspo"))
    for i in range(len(adv)):
        n = mask[i].sum()
        if n:
            expected = np.exp(((logp[i] - old[i]) * mask[i]).sum() / n)
            np.testing.assert_allclose(ratio[i], expected, rtol=1e-6)


def test_kl_estimators():
    logp, ref = np.log([0.5, 0.2, 0.9]), np.log([0.4, 0.3, 0.9])
    x = logp - ref
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), x, rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2"), 0.5 * x**2, rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), np.exp(-x) + x - 1, rtol=1e-6)
    assert (np.asarray(kl_penalty(logp, ref, "k3")) >= 0).all()


# --------------------------------------------- micro-batches on a real model


def _rl_batch(rows=8, t=20, seed=0, vocab=512, groups=1, pack=True):
    """Prompt + completion sequences of unequal lengths through `build_rl_batch` (packed `groups` ways, pairs
    sharing their prompt, or one per row), with sampler / old / ref log-probs; the first two completions are a
    masked group."""
    from posttrain.rl_batch import build_rl_batch
    from rollout.sampler import Completion

    rng = np.random.default_rng(seed)
    max_tokens = 15
    comps = []
    for i in range(rows):
        if i % 2 == 0:  # each prompt has two completions
            prompt = list(rng.integers(3, vocab, int(rng.integers(2, 6))))
        n = min(int(rng.integers(8, t + 1)) - len(prompt), max_tokens)
        comps.append(Completion(prompt, list(rng.integers(3, vocab, n)), None, "stop", ""))
    keep = np.arange(rows) >= 2
    batch = build_rl_batch(comps, rng.normal(size=rows).astype(np.float32), keep, row_len=2 * t,
                           max_tokens=max_tokens, groups=groups, pack=pack)
    done = batch.pop("completion_mask")
    old = (-rng.uniform(4, 8, done.shape) * done).astype(np.float32)
    return {
        **batch, "completion_mask": done, "old_logp": old,
        "sampler_logp": (old + rng.normal(0, 0.1, old.shape) * done).astype(np.float32),
        "ref_logp": (old + rng.normal(0, 0.1, old.shape) * done).astype(np.float32),
    }


@pytest.mark.parametrize("algorithm,agg", [("grpo", a) for a in AGGS] + [("gspo", "sequence-mean-token-mean")])
def test_micro_batches_give_the_same_gradient(agg, algorithm):
    from flax import nnx

    from core.config import ModelConfig, OptimConfig
    from core.models import create_model
    from core.optim import make_optimizer
    from core.train import init_train_state, jit_train_step, make_train_step, split_micro_batches
    from posttrain.objective import make_policy_objective

    settings = PolicyLossSettings(algorithm=algorithm, loss_agg=agg, beta=0.05, tis_cap=2.0, max_tokens=19)
    loss_fn = make_policy_objective(settings, temperature=0.7)
    sgd = OptimConfig(name="sgd", learning_rate=1.0, schedule="constant", grad_clip_norm=None)
    results, start = [], None
    # one row per sequence in one micro-batch vs sequences packed four groups' worth of rows, 4 micro-batches
    for k, pack in ((1, False), (4, True)):
        batch = _rl_batch(groups=k, pack=pack)
        model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
        tx = make_optimizer(sgd, 10, nnx.state(model))
        graphdef, state = init_train_state(model, tx, seed=0)
        start = jax.device_get(state.params)
        step = jit_train_step(make_train_step(graphdef, loss_fn, tx), state)
        state, metrics = step(state, split_micro_batches(batch, k))
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    assert len(batch["tokens"]) < len(batch["advantages"])  # the packed batch really shares rows
    (p1, m1), (p4, m4) = results
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), abs=1e-6)
    assert float(m1["grad_norm"]) > 0
    # SGD with lr 1: the parameter change is the gradient; compare in float32 terms.
    diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)))
    update = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(start)))
    assert diff <= 1e-5 * update, (diff, update)


def _mismatch_reference(trainer, sampler, mask):
    """NumPy: mean / max |gap| over completion tokens, mean over sequences of sum_t (sampler - trainer)."""
    m = mask > 0
    gap = np.abs(trainer - sampler)[m]
    per_seq = ((sampler - trainer) * mask).sum(axis=1)[m.any(axis=1)]
    return {"mismatch/logp_gap_mean": gap.mean(), "mismatch/logp_gap_max": gap.max(), "mismatch/seq_kl": per_seq.mean()}


@pytest.mark.parametrize("algorithm,agg", [("grpo", "token-mean"), ("gspo", "sequence-mean-token-mean")])
def test_one_update_takes_pi_old_from_its_own_forward_pass(algorithm, agg):
    """Without `old_logp` the step uses stop_gradient(logp) as pi_old: the same update as a separate
    pi_old pass, for 1 and 4 micro-batches, and the mismatch statistics (max-reduced across
    micro-batches) match a NumPy reference on the trainer's log-probs."""
    from flax import nnx

    from core.config import ModelConfig, OptimConfig
    from core.models import create_model
    from core.optim import make_optimizer
    from core.train import init_train_state, jit_train_step, make_train_step, split_micro_batches
    from posttrain.learner import summarise_updates
    from posttrain.objective import make_policy_objective, target_logprobs

    settings = PolicyLossSettings(algorithm=algorithm, loss_agg=agg, tis_cap=2.0, max_tokens=19)
    loss_fn = make_policy_objective(settings, temperature=0.7)
    # the same sequences packed for 1 and for 4 micro-batches; the masked group's tokens still count for the
    # mismatch (completion_mask)
    batches = {k: _rl_batch(groups=k) for k in (1, 4)}
    sgd = OptimConfig(name="sgd", learning_rate=1.0, schedule="constant", grad_clip_norm=None)
    model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
    mask = batches[1]["completion_mask"]
    trainer_logp = np.asarray(jax.jit(lambda m, b: target_logprobs(m, b, 0.7)[0])(model, batches[1])) * (mask > 0)
    sampler_logp = (trainer_logp + 0.05 * np.sin(np.arange(trainer_logp.size)).reshape(trainer_logp.shape)
                    * mask).astype(np.float32)
    expected = _mismatch_reference(trainer_logp, sampler_logp, mask)
    results = {}
    for name, k in (("separate", 1), ("fused", 1), ("fused", 4)):
        model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
        tx = make_optimizer(sgd, 10, nnx.state(model))
        graphdef, state = init_train_state(model, tx, seed=0)
        start = jax.device_get(state.params)
        b = {key: v for key, v in batches[k].items() if key not in ("old_logp", "ref_logp")}
        b["sampler_logp"] = sampler_logp
        inputs = dict(b, old_logp=trainer_logp.astype(np.float32)) if name == "separate" else b
        step = jit_train_step(make_train_step(graphdef, loss_fn, tx), state)
        state, metrics = step(state, split_micro_batches(inputs, k))
        metrics = {key: float(v) for key, v in jax.device_get(metrics).items()}
        results[name, k] = (jax.device_get(state.params), summarise_updates([metrics], 1))
        for key, value in expected.items():
            assert results[name, k][1][key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), (name, k, key)
    base = results["separate", 1][0]
    update = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(start)))
    assert update > 0
    for key in (("fused", 1), ("fused", 4)):
        diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(results[key][0]), jax.tree.leaves(base)))
        assert diff <= 1e-5 * update, (key, diff, update)


def test_pass_at_k_matches_enumeration():
    from itertools import combinations

    from posttrain.evaluation import majority_correct, pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                samples = [True] * c + [False] * (n - c)
                subsets = list(combinations(range(n), k))
                expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert majority_correct(["4", " 4", "5", None], [True, True, False, False])
    assert not majority_correct(["5", "5", "4"], [False, False, True])
    assert not majority_correct([None, None], [False, False])
