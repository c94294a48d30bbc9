"""GRPO / GSPO policy losses against small NumPy references written from the papers' formulas, their micro-batch
invariance and pi_old from the update's own forward pass."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses.correction import CorrectionSettings
from posttrain.losses.policy import PolicyLossSettings, policy_loss

AGGS = ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"]


def tis(cap: float | None, algorithm: str = "grpo") -> CorrectionSettings:
    """Truncated importance sampling capped at `cap` (None: off), at the algorithm's ratio's level."""
    if cap is None:
        return CorrectionSettings("off")
    return CorrectionSettings("geometric_truncate" if algorithm == "gspo" else "token_truncate", hi=cap)


def tis_cap(s: PolicyLossSettings) -> float | None:
    return None if s.correction.mode == "off" else s.correction.hi


# ------------------------------------------------------------ NumPy references


def np_policy_loss(logp, old, adv, mask, s: PolicyLossSettings, sampler=None, ref=None, kl_mask=None):
    """Loss value and d loss / d logp, token by token. The policy term counts on `mask`, the KL term on
    `kl_mask` (default `mask`); a token counts in the normaliser when either term does."""
    B, T = logp.shape
    kl_mask = mask if kl_mask is None else kl_mask
    counted = np.maximum(mask, kl_mask) if s.beta > 0 else mask
    pol = np.zeros((B, T))  # each token's policy term
    dpol = np.zeros((B, T))  # its derivative w.r.t. the ratio's log (GSPO: the sequence's)
    kl = np.zeros((B, T))
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
            if tis_cap(s) is not None and sampler is not None:
                if s.algorithm == "grpo":
                    w = min(np.exp(old[i, t] - sampler[i, t]), tis_cap(s))
                else:  # geometric mean over the sequence's tokens
                    w = min(
                        np.exp(sum(mask[i, u] * (old[i, u] - sampler[i, u]) for u in range(T)) / max(n, 1)), tis_cap(s)
                    )
                loss, d = loss * w, d * w
            pol[i, t], dpol[i, t] = loss, d
            if s.beta > 0:
                x = logp[i, t] - ref[i, t]
                k3 = np.exp(-x) + x - 1
                value, slope = {
                    "k1": (x, 1.0),
                    "k2": (0.5 * x * x, x),
                    "k3": (k3, 1 - np.exp(-x)),
                    "low_var_kl": (min(k3, 10.0), 1 - np.exp(-x) if k3 < 10.0 else 0.0),
                }[s.kl_estimator]
                kl[i, t], dkl[i, t] = value, s.beta * slope
    lengths = counted.sum(1)
    if s.loss_agg == "token-mean":
        weight = np.full((B, T), 1.0 / counted.sum())
    elif s.loss_agg == "sequence-mean-token-mean":
        weight = np.repeat(1.0 / np.maximum(lengths, 1)[:, None] / (lengths > 0).sum(), T, axis=1)
    else:  # Dr.GRPO: every sequence of the batch times the generation budget
        weight = np.full((B, T), 1.0 / (B * s.max_tokens))
    value = ((pol * mask + s.beta * kl * kl_mask) * weight).sum()
    if s.algorithm == "grpo":
        grad = (dpol * mask + dkl * kl_mask) * weight
    else:  # d/dlogp_t of sum_t' w_t' loss(s): the sequence ratio depends on every token, d s / d logp_t = s m_t / n
        grad = np.zeros_like(pol)
        for i in range(B):
            n = max(mask[i].sum(), 1)
            total = sum(weight[i, t] * dpol[i, t] * mask[i, t] for t in range(T))
            grad[i] = total * mask[i] / n + dkl[i] * kl_mask[i] * weight[i]
    return value, grad


def np_branches(logp, old, adv, mask, s: PolicyLossSettings, sampler=None):
    """How many counted tokens take the PPO clip, the dual clip and the TIS cap (NumPy, for the tests that
    check that their data reaches each branch)."""
    high = s.epsilon if s.epsilon_high is None else s.epsilon_high
    n = np.maximum(mask.sum(1, keepdims=True), 1)
    log_r = (
        logp - old
        if s.algorithm == "grpo"
        else np.broadcast_to(((logp - old) * mask).sum(1, keepdims=True) / n, logp.shape)
    )
    r, a = np.exp(log_r), adv[:, None]
    unclipped, clipped = -a * r, -a * np.clip(r, 1 - s.epsilon, 1 + high)
    out = {"clip": int(((clipped > unclipped) & (mask > 0)).sum())}
    if s.dual_clip is not None:
        out["dual_clip"] = int(((a < 0) & (np.maximum(unclipped, clipped) > -a * s.dual_clip) & (mask > 0)).sum())
    if tis_cap(s) is not None and sampler is not None:
        log_w = old - sampler
        if s.algorithm == "gspo":
            log_w = np.broadcast_to((log_w * mask).sum(1, keepdims=True) / n, log_w.shape)
        out["tis_cap"] = int(((np.exp(log_w) > tis_cap(s)) & (mask > 0)).sum())
    return out


def _data(seed, B=10, T=10, spread=0.8, sampler_spread=0.6):
    """Log-probs with ratios wide enough to reach every clip and cap; unequal lengths; sequence B-1 has no policy
    tokens (a zero-variance group) but KL tokens, sequence B-2 no tokens at all (a failed group), and the KL
    term covers tokens the policy term does not (truncated completions with DAPO's mask)."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3.0, (B, T))
    old = logp + rng.normal(0, spread, (B, T))
    sampler = old + rng.normal(0, sampler_spread, (B, T))
    ref = logp + rng.normal(0, 0.3, (B, T))
    adv = rng.normal(0, 1.0, B)
    kl_lengths = rng.integers(2, T + 1, B)
    lengths = np.minimum(kl_lengths, rng.integers(1, T + 1, B))  # policy tokens: a prefix of the KL tokens
    lengths[-1] = 0
    lengths[-2] = kl_lengths[-2] = 0
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    kl_mask = (np.arange(T)[None] < kl_lengths[:, None]).astype(np.float64)
    return logp, old, sampler, ref, adv, mask, kl_mask


def _jax_loss(logp, old, adv, mask, s, sampler=None, ref=None, kl_mask=None):
    def total(lp):
        loss_sum, denominator, terms = policy_loss(
            lp,
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            s,
            None if sampler is None else jnp.asarray(sampler),
            None if ref is None else jnp.asarray(ref),
            None if kl_mask is None else jnp.asarray(kl_mask),
        )
        return loss_sum / denominator, terms

    (value, terms), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(logp, jnp.float32))
    return float(value), np.asarray(grad), terms


# ------------------------------------------------------------------- tests


CASES = [
    PolicyLossSettings(
        algorithm=algo,
        loss_agg=agg,
        epsilon=0.2,
        epsilon_high=high,
        dual_clip=dual,
        correction=tis(cap, algo),
        beta=beta,
        kl_estimator=est,
        max_tokens=9,
    )
    for algo, agg, (high, dual, cap, beta, est) in itertools.product(
        ["grpo", "gspo"],
        AGGS,
        [
            (None, None, None, 0.0, "k3"),
            (0.28, 3.0, 2.0, 0.0, "k3"),
            (None, None, 1.5, 0.05, "k1"),
            (0.3, None, None, 0.1, "k2"),
            (None, 1.5, None, 0.02, "k3"),
            (None, 1.5, 1.5, 0.05, "low_var_kl"),
        ],
    )
]


@pytest.mark.parametrize(
    "s", CASES, ids=lambda s: f"{s.algorithm}-{s.loss_agg}-{s.dual_clip}-{tis_cap(s)}-{s.beta}-{s.kl_estimator}"
)
def test_policy_loss_and_gradient_match_numpy(s):
    logp, old, sampler, ref, adv, mask, kl_mask = _data(13)
    # the data must reach every branch the case configures (and not only that branch), or the table tests nothing
    counted = int(mask.sum())
    for branch, hits in np_branches(logp, old, adv, mask, s, sampler).items():
        assert 0 < hits < counted, (branch, hits, counted)
    value, grad, terms = _jax_loss(logp, old, adv, mask, s, sampler, ref, kl_mask)
    ref_value, ref_grad = np_policy_loss(logp, old, adv, mask, s, sampler, ref, kl_mask)
    assert value == pytest.approx(ref_value, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6)
    assert float(terms.clipped_tokens) == np_branches(logp, old, adv, mask, s)["clip"]
    if s.beta > 0:  # the KL term reaches tokens the policy term does not (a zero-variance or truncated sequence)
        assert np.abs(ref_grad[-1]).sum() > 0 and float(terms.kl_tokens) == kl_mask.sum() > mask.sum()


def test_dr_grpo_normaliser_does_not_depend_on_filtering():
    """Dr.GRPO divides by (sequences in the batch) x max_tokens: masking 3 of 4 groups out (flat rewards) gives
    the gradient of the same batch with those groups in and zero advantages, not 4x it."""
    logp, old, _sampler, _, adv, _, _ = _data(4, B=8, T=6)
    full = np.ones_like(logp)
    flat = np.arange(8) >= 2  # groups 2-4 (2 completions each) have equal rewards
    adv = np.where(flat, 0.0, adv)
    s = PolicyLossSettings(loss_agg="sequence-mean-token-sum-norm", max_tokens=6, correction=tis(None))
    _, masked_grad, _ = _jax_loss(logp, old, adv, np.where(flat[:, None], 0.0, full), s)
    _, kept_grad, _ = _jax_loss(logp, old, adv, full, s)
    assert np.abs(kept_grad).sum() > 0
    np.testing.assert_allclose(masked_grad, kept_grad, atol=1e-7)


def test_all_truncated_group_and_zero_advantages():
    # Sequences with no counted token (masked out or truncated under mask_truncated, no KL) contribute nothing.
    logp, old, _sampler, _ref, adv, mask, _ = _data(2)
    mask[:3] = 0.0
    for s in (PolicyLossSettings(loss_agg=a) for a in AGGS):
        value, grad, _terms = _jax_loss(logp, old, adv, mask, s)
        ref_value, _ref_grad = np_policy_loss(logp, old, adv, mask, s)
        assert value == pytest.approx(ref_value, abs=1e-6)
        np.testing.assert_allclose(grad[:3], 0.0)
    value, grad, _ = _jax_loss(logp, old, np.zeros_like(adv), mask, PolicyLossSettings())
    assert value == 0.0 and not grad.any()


def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    logp, old, _, _, adv, mask, _ = _data(3)
    from posttrain.losses.policy import importance_ratio

    ratio = np.asarray(importance_ratio(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), "gspo"))
    for i in range(len(adv)):
        n = mask[i].sum()
        if n:
            expected = np.exp(((logp[i] - old[i]) * mask[i]).sum() / n)
            np.testing.assert_allclose(ratio[i], expected, rtol=1e-6)


def _rl_batch(rows=8, t=20, seed=0, vocab=512, groups=1, pack=True):
    """Prompt + completion sequences of unequal lengths through `build_rl_batch` (packed `groups` ways, pairs
    sharing their prompt, or one per row), with sampler / old / ref log-probs; the first two completions are a
    zero-variance group (no policy tokens, KL tokens)."""
    from posttrain.onpolicy.rl_batch import build_rl_batch
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
    # the masked group still carries the KL term (rl.loss.kl_every_token), so every micro-batch has KL-only tokens
    batch = build_rl_batch(
        comps,
        rng.normal(size=rows).astype(np.float32),
        keep,
        row_len=2 * t,
        max_tokens=max_tokens,
        groups=groups,
        pack=pack,
        kl_keep=np.ones(rows, bool),
    )
    done = batch.packed.target_mask
    old = (-rng.uniform(4, 8, done.shape) * done).astype(np.float32)
    return batch.replace(
        old_logp=old,
        sampler_logp=(old + rng.normal(0, 0.1, old.shape) * done).astype(np.float32),
        ref_logp=(old + rng.normal(0, 0.1, old.shape) * done).astype(np.float32),
    )


@pytest.mark.parametrize("algorithm,agg", [("grpo", a) for a in AGGS] + [("gspo", "sequence-mean-token-mean")])
def test_micro_batches_give_the_same_gradient(agg, algorithm):
    from core.config import ModelConfig
    from core.models import create_model
    from core.train import split_micro_batches
    from posttrain.onpolicy.policy_gradient import policy_objective
    from tests.helpers import assert_same_gradients, jitted_step, recording_sgd

    settings = PolicyLossSettings(
        algorithm=algorithm, loss_agg=agg, beta=0.05, correction=tis(2.0, algorithm), max_tokens=19
    )
    loss_fn = policy_objective(settings, temperature=0.7)
    results = []
    # one row per sequence in one micro-batch vs sequences packed four groups' worth of rows, 4 micro-batches
    for k, pack in ((1, False), (4, True)):
        batch = _rl_batch(groups=k, pack=pack)
        model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
        tx = recording_sgd(1.0)  # its state is the gradient the step applied
        step, state, rest = jitted_step(model, loss_fn, tx)
        state, metrics = step(state, split_micro_batches(batch, k), rest)
        results.append((jax.device_get(state.opt_state), jax.device_get(metrics)))
    assert len(batch.packed.tokens) < len(batch.advantages)  # the packed batch really shares rows
    (g1, m1), (g4, m4) = results
    for m in (m1, m4):  # both steps ran on real tokens
        assert float(m.finite) == 1.0 and float(m.empty) == 0.0 and float(m.grad_norm) > 0
    assert float(m1.loss) == pytest.approx(float(m4.loss), abs=1e-6)
    # every tensor, in float32 steps of its own scale: one sequence per row vs packed rows changes the order of
    # every sum (attention over other row lengths, the embedding's scatter over ~250 tokens): measured 43-58 steps
    assert_same_gradients(g1, g4, steps=96)


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
    from core.config import ModelConfig
    from core.models import create_model
    from core.sums import to_host
    from core.targets import target_logprobs
    from core.train import split_micro_batches
    from posttrain.onpolicy.policy_gradient import PolicyStats, policy_objective
    from tests.helpers import assert_same_gradients, jitted_step, recording_sgd

    settings = PolicyLossSettings(algorithm=algorithm, loss_agg=agg, correction=tis(2.0, algorithm), max_tokens=19)
    loss_fn = policy_objective(settings, temperature=0.7)
    # the same sequences packed for 1 and for 4 micro-batches; the masked group's tokens still count for the
    # mismatch (completion_mask)
    batches = {k: _rl_batch(groups=k) for k in (1, 4)}
    model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
    mask = batches[1].packed.target_mask
    trainer_logp = np.asarray(jax.jit(lambda m, b: target_logprobs(m, b, 0.7)[0])(model, batches[1].packed)) * (
        mask > 0
    )
    sampler_logp = (
        trainer_logp + 0.05 * np.sin(np.arange(trainer_logp.size)).reshape(trainer_logp.shape) * mask
    ).astype(np.float32)
    expected = _mismatch_reference(trainer_logp, sampler_logp, mask)
    # The step recomputes the trainer's log-probs, in another row layout for 4 micro-batches: each token's may
    # differ from the reference's by a few float32 steps of its size, and seq_kl sums max_tokens of them into a
    # small difference (measured 1.3e-6 here on 4 micro-batches, ~3 steps of a log-prob near -6).
    ulp = float(np.spacing(np.float32(np.abs(trainer_logp).max())))
    tolerance = {"mismatch/logp_gap_mean": 4 * ulp, "mismatch/logp_gap_max": 4 * ulp}
    tolerance["mismatch/seq_kl"] = 2 * settings.max_tokens * ulp
    results = {}
    for name, k in (("separate", 1), ("fused", 1), ("fused", 4)):
        model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
        tx = recording_sgd(1.0)  # its state is the gradient the step applied
        step, state, rest = jitted_step(model, loss_fn, tx)
        b = batches[k].replace(old_logp=None, ref_logp=None, sampler_logp=sampler_logp)
        inputs = b.replace(old_logp=trainer_logp.astype(np.float32)) if name == "separate" else b
        state, update = step(state, split_micro_batches(inputs, k), rest)
        update = to_host(jax.device_get(update))
        assert update.finite == 1.0 and update.empty == 0.0 and update.grad_norm > 0
        stats = PolicyStats.summarise([update], 1, settings).metrics()
        results[name, k] = jax.device_get(state.opt_state)
        for key, value in expected.items():
            assert stats[key] == pytest.approx(float(value), rel=1e-4, abs=tolerance[key]), (name, k, key)
    for key in (("fused", 1), ("fused", 4)):  # every tensor, in float32 steps of that tensor
        assert_same_gradients(results["separate", 1], results[key])
