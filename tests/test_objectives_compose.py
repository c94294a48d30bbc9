"""The objectives and corrections of `rl.loss.type` / `rl.rollout_correction` compose with what the policy-gradient
step already had: LoRA, a mixture of experts with routing replay, an agent's loss mask (environment tokens inside a
completion), GSPO's sequence ratio, and several updates a step (`rl.batch.num_iterations=2`: the second update is
off-policy, its ratio has left 1).

Each case is a GRPO learner stepped on a batch whose sampler log-probs are pi_old's (the trainer's, attached as the
step attaches them) minus known noise, so the correction's weight is exp(noise) and what it must act on is computed
here in NumPy: the share of tokens or sequences the step reports masked or truncated equals it, and is neither 0 nor
1 (the branch is reached on some inputs, not all). Each step trains (gradient non-zero); LoRA leaves the base alone.
The process group runs the same jitted step (`tests/test_trainer_group.py` runs GRPO with CISPO and a correction).
"""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.grpo import GRPO
from posttrain.onpolicy.rl_batch import build_rl_batch
from rollout.sampler import Completion
from tests.helpers import method_learner
from tests.test_lora_methods import LORA, frozen_base, same
from tests.test_moe_methods import QWEN3_MOE

TWO_UPDATES = ["rl.batch.num_iterations=2", "rl.loss.beta=0.05", "optim.learning_rate=1.0e-2", "train.steps=2"]


def _completions(rng, *, agent: bool, routes_for=None) -> list[Completion]:
    """8 completions of 6 tokens; `agent`: tokens 2-3 written by an environment (no loss); `routes_for`: the
    config whose sparse layers get recorded routes (each token's experts (t + 1, t + 2) mod 4)."""
    comps = []
    for i in range(8):
        prompt, tokens = [int(x) for x in rng.integers(3, 500, 4)], [int(x) for x in rng.integers(3, 500, 6)]
        sampled = [True, True, False, False, True, True] if agent else None
        c = Completion(prompt, tokens, [-6.0] * 6, "stop", "", sampled=sampled)
        if routes_for is not None:
            n, sparse = len(prompt) + len(tokens), sum(routes_for.model.sparse_layers)
            c.routes = ((np.arange(n)[:, None, None] + i + np.arange(1, 3)[None, None, :]) % 4).repeat(sparse, 1)
            c.routes = c.routes.astype(np.int32)
        comps.append(c)
    return comps


def _expected(noise: np.ndarray, mask: np.ndarray, level: str, lo: float, hi: float) -> dict[str, float]:
    """What the correction must report for log w = old - sampler = `noise` at `level`, over the counted tokens
    `mask` only: the shares of tokens outside [lo, hi], of sequences wholly outside (masked) and of sequences with
    any token outside (truncated), and the largest ratio before the action."""
    d = noise * mask
    n = np.maximum(mask.sum(-1, keepdims=True), 1)
    log_w = {"token": d, "sequence": d.sum(-1, keepdims=True), "geometric": d.sum(-1, keepdims=True) / n}[level]
    log_w = np.broadcast_to(log_w, d.shape)
    counted, rows = mask > 0, mask.sum(-1) > 0
    outside = ((log_w < np.log(lo)) | (log_w > np.log(hi))) & counted
    return {
        "tokens": outside.sum() / counted.sum(),
        "masked_sequences": (outside.sum(-1) >= counted.sum(-1))[rows].mean(),
        "truncated_sequences": (outside.sum(-1) > 0)[rows].mean(),
        "ratio_max": float(np.exp(log_w[counted].max())),
    }


CASES = {
    # case: (overrides, completions' kind, the correction's level, action, lo, hi); each trust region narrowed, so
    # that the second (off-policy) update's ratios reach it (SAPO's gate cuts no token off)
    "lora+cispo+token_mask": (
        [*LORA, "rl.loss.type=cispo", "rl.loss.cispo_cap=1.0001"],
        "plain",
        "token",
        "mask",
        0.8,
        1.25,
    ),
    "moe_replay+gmpo+sequence_truncate": (
        [*QWEN3_MOE, "rl.router_replay=replay", "rl.loss.type=gmpo", "rl.loss.epsilon=1.0e-4"],
        "routes",
        "sequence",
        "truncate",
        0.5,
        2.0,
    ),
    "agent_mask+sapo+geometric_mask": (["rl.loss.type=sapo"], "agent", "geometric", "mask", 0.9, 1.1),
    "gspo+geometric_truncate": (
        ["rl.algorithm=gspo", "rl.loss.epsilon=1.0e-6"],
        "plain",
        "geometric",
        "truncate",
        0.9,
        1.1,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_objective_and_a_correction_compose_with_the_step(case):
    overrides, kind, level, action, lo, hi = CASES[case]
    correction = f"rl.rollout_correction={{mode: {level}_{action}, lo: {lo}, hi: {hi}}}"
    learner, cfg = method_learner("recipes/configs/grpo_tiny.yml", GRPO, *TWO_UPDATES, *overrides, correction)
    rng = np.random.default_rng(0)
    comps = _completions(rng, agent=kind == "agent", routes_for=cfg if kind == "routes" else None)
    batch = build_rl_batch(
        comps, rng.normal(size=8), np.ones(8, bool), row_len=32, max_tokens=8, groups=1, replay=kind == "routes"
    )
    attached, _ = learner.attach(batch)  # pi_old, as the step attaches it
    old, mask = np.asarray(attached.old_logp), np.asarray(batch.loss_mask)
    noise = rng.normal(0.0, 0.3, old.shape).astype(np.float32)
    if kind == "agent":
        assert mask[:, 2:4].sum() == 0 and mask.sum() > 0  # the environment's tokens carry no policy loss
        noise[:, 2:4] = 5.0  # far outside any bound: a correction that counted the environment's tokens would show
    base = frozen_base(learner.learner) if "lora" in case else None
    metrics = learner.train(batch.replace(sampler_logp=(old - noise).astype(np.float32))).metrics

    want = _expected(noise, mask, level, lo, hi)
    acted = "masked" if action == "mask" else "truncated"
    assert 0 < want["tokens"] < 1, "the bounds act on some tokens, not all: the check can fail"
    assert metrics[f"correction/{acted}_tokens"] == pytest.approx(want["tokens"], abs=1e-6)
    assert metrics[f"correction/{acted}_sequences"] == pytest.approx(want[f"{acted}_sequences"], abs=1e-6)
    assert metrics["correction/ratio_max"] == pytest.approx(want["ratio_max"], rel=1e-4)
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
    # the second update is off-policy: its ratios left 1 and reached the objective's trust region
    assert metrics["ratio/min"] < 1 < metrics["ratio/max"], metrics
    assert (metrics["clip_fraction"] > 0) == ("sapo" not in case), metrics["clip_fraction"]
    if base is not None:  # LoRA: the adapters trained, the base did not move
        assert same(base, learner.learner.rest)


def test_a_correction_that_masks_every_token_leaves_no_policy_gradient():
    """The correction's weight multiplies the loss, not only its metrics: with bounds that leave out every token's
    ratio (and no KL term), a step has no gradient; the same batch with the correction off has one."""
    rng = np.random.default_rng(0)
    comps = _completions(rng, agent=False)
    grads = {}
    for mode in ("{mode: token_mask, lo: 100.0, hi: 200.0}", "{mode: off}"):
        learner, _ = method_learner(
            "recipes/configs/grpo_tiny.yml", GRPO, "train.steps=1", f"rl.rollout_correction={mode}"
        )
        batch = build_rl_batch(comps, np.linspace(-1, 1, 8), np.ones(8, bool), row_len=32, max_tokens=8, groups=1)
        metrics = learner.train(batch).metrics  # the sampler's log-probs: the scripted -6.0 a token, ratios ~0.8
        grads[mode] = metrics["grad_norm"]
        assert metrics["ratio/min"] == metrics["ratio/max"] == 1.0  # one update a step: at pi_old
        if "mask" in mode:
            assert metrics["correction/masked_tokens"] == 1.0
    assert grads["{mode: token_mask, lo: 100.0, hi: 200.0}"] == 0.0 and grads["{mode: off}"] > 0
