"""The objectives `rl.loss.type` names and the rollout corrections `rl.rollout_correction.mode` names: against TRL's
own code on the same tensors where TRL has them (values, gradients, weights; tests/fixtures/trl_rl_objectives.json,
made by tests/fixtures/make_trl_rl_objectives.py; half the sequences' advantages positive, half negative), against
NumPy written from the papers (clip, CISPO, SAPO; and DPPO and the geometric-mean corrections, which TRL does not
have), and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig
from posttrain.losses.correction import CorrectionSettings, rollout_correction
from posttrain.losses.policy import PolicyLossSettings, policy_loss
from posttrain.onpolicy.policy_gradient import correction_metrics, loss_settings

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "trl_rl_objectives.json").read_text())
LOGP, OLD, SAMPLER, ADV, MASK, ENTROPY = (
    np.asarray(FIXTURE[k]) for k in ("logp", "old", "sampler", "adv", "mask", "entropy")
)


def settings_for(case: dict) -> PolicyLossSettings:
    """Temper's settings for a TRL case: the same objective, parameters, aggregation and correction."""
    args, kind = case["args"], case["loss_type"]
    mode = case["mode"] or "off"
    correction = CorrectionSettings(mode, case.get("lo"), case.get("hi"))  # type: ignore[arg-type]
    common = dict(correction=correction, max_tokens=MASK.shape[1], entropy_coef=args.get("entropy_coef", 0.0))
    if kind == "grpo":  # TRL's "grpo": each sequence's token mean, then their mean
        return PolicyLossSettings(type="clip", loss_agg="sequence-mean-token-mean", **common)
    if kind == "dapo":
        return PolicyLossSettings(type="clip", epsilon_high=args["epsilon_high"], loss_agg="token-mean", **common)
    if kind == "cispo":
        return PolicyLossSettings(type="cispo", cispo_cap=args["epsilon_high"], loss_agg="token-mean", **common)
    if kind == "sapo":
        taus = dict(sapo_tau_pos=args.get("tau_pos", 1.0), sapo_tau_neg=args.get("tau_neg", 1.05))
        return PolicyLossSettings(type="sapo", loss_agg="sequence-mean-token-mean", **taus, **common)
    assert kind == "gmpo"
    eps, high = args["epsilon"], args.get("epsilon_high", args["epsilon"])
    return PolicyLossSettings(
        type="gmpo", epsilon=eps, epsilon_high=high, loss_agg="sequence-mean-token-mean", **common
    )


def temper_loss(settings: PolicyLossSettings, logp=LOGP, old=OLD, sampler=SAMPLER, adv=ADV, mask=MASK):
    """Temper's loss, its gradient w.r.t. the policy's log-probs, its terms, and its gradient w.r.t. the entropy."""

    def total(lp, entropy):
        s, d, terms = policy_loss(
            lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), settings, jnp.asarray(sampler), entropy=entropy
        )
        return s / d, terms

    args = (jnp.asarray(logp, jnp.float32), jnp.asarray(ENTROPY, jnp.float32))
    (value, terms), (grad, entropy_grad) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(*args)
    return float(value), np.asarray(grad), terms, np.asarray(entropy_grad)


def case_id(case: dict) -> str:
    return "-".join(
        str(x) for x in (case["loss_type"], case["mode"], case.get("lo"), case.get("hi"), *case["args"].values())
    )


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=case_id)
def test_each_objective_and_correction_matches_trls_code(case):
    settings = settings_for(case)
    value, grad, terms, entropy_grad = temper_loss(settings)
    assert np.abs(grad).sum() > 0  # the loss trains
    assert value == pytest.approx(case["value"], abs=2e-6)
    np.testing.assert_allclose(grad, np.asarray(case["grad"]), atol=2e-6)
    if "entropy_grad" in case:  # the bonus: the same pull on every counted token's entropy, whatever the aggregation
        np.testing.assert_allclose(entropy_grad, np.asarray(case["entropy_grad"]), atol=1e-7)
        assert np.abs(entropy_grad).sum() > 0
    ratio = np.exp(LOGP - OLD)
    counted = MASK > 0
    # The data reaches the branch each case configures, on some tokens and not all.
    if case["loss_type"] == "cispo":
        capped = (ratio > settings.cispo_cap) & counted
        assert 0 < capped.sum() < counted.sum() and float(terms.clipped_tokens) == capped.sum()
    if case["loss_type"] == "gmpo":
        outside = (np.abs(LOGP - OLD) > settings.epsilon) & counted
        assert 0 < outside.sum() < counted.sum()
    if case["mode"] is not None:
        trl = np.broadcast_to(np.asarray(case["weights"]), MASK.shape)
        c = rollout_correction(jnp.asarray(OLD), jnp.asarray(SAMPLER), jnp.asarray(MASK), settings.correction)
        np.testing.assert_allclose(np.asarray(c.weight)[counted], trl[counted], rtol=2e-5, atol=1e-7)
        raw = np.exp(np.asarray(c.log_ratio))
        lo, hi = case["lo"] or 0.0, case["hi"] or np.inf
        acted = ((raw < lo) | (raw > hi)) & counted
        assert 0 < acted.sum() < counted.sum()
        if case["mode"].endswith("mask"):
            assert float(terms.correction_masked) == acted.sum() and (trl[acted] == 0).all()
        else:
            assert float(terms.correction_truncated) == acted.sum()


# ---------------------------------------------------------------- NumPy references where TRL has none


def np_correction(mode: str, lo, hi, old=OLD, sampler=SAMPLER, mask=MASK) -> np.ndarray:
    """The weight per token, from the definitions (docs/grpo.md): the level's log ratio, then truncated or masked."""
    d = (old - sampler) * mask
    level, action = mode.split("_")
    n = np.maximum(mask.sum(1, keepdims=True), 1)
    log_w = {"token": d, "sequence": d.sum(1, keepdims=True) + 0 * d, "geometric": d.sum(1, keepdims=True) / n + 0 * d}
    w = np.exp(log_w[level])
    lo, hi = (lo if lo is not None else 0.0), (hi if hi is not None else np.inf)
    return np.clip(w, lo, hi) if action == "truncate" else np.where((w >= lo) & (w <= hi), w, 0.0)


@pytest.mark.parametrize(
    "mode,lo,hi",
    [("geometric_truncate", 0.9, 1.1), ("geometric_mask", 0.95, 1.05), ("geometric_mask", None, 1.1),
     ("token_mask", None, 1.2), ("sequence_truncate", None, 1.5)],
)  # fmt: skip
def test_every_correction_mode_matches_numpy(mode, lo, hi):
    c = rollout_correction(jnp.asarray(OLD), jnp.asarray(SAMPLER), jnp.asarray(MASK), CorrectionSettings(mode, lo, hi))
    expected = np_correction(mode, lo, hi)
    counted = MASK > 0
    np.testing.assert_allclose(np.asarray(c.weight)[counted], expected[counted], rtol=2e-5)
    raw = np.exp(np.asarray(c.log_ratio))
    acted = ((raw < (lo or 0)) | (raw > (hi or np.inf))) & counted
    assert 0 < acted.sum() < counted.sum()


def test_a_floor_of_zero_is_no_floor():
    """`lo: 0` keeps a sequence however small its ratio (TRL's min 0), even one whose log ratio is -100."""
    d = np.zeros((2, 4))
    d[0] = -25.0  # sequence 0: log ratio -100 at the sequence level
    c = rollout_correction(
        jnp.asarray(d), jnp.zeros((2, 4)), jnp.ones((2, 4)), CorrectionSettings("sequence_mask", 0.0, 3.0)
    )
    assert float(np.asarray(c.masked).sum()) == 0.0


def np_dppo(logp, behaviour, adv, mask, delta, cap):
    """DPPO-Binary-TV (arXiv 2602.04879): -A * sg(min(pi/mu, cap)) * log pi on the tokens whose probability moved by
    at most delta from the sampler's in the direction A pushes it; its value and d/d log pi (token mean)."""
    p, mu = np.exp(logp), np.exp(behaviour)
    a = adv[:, None]
    valid = np.where(a > 0, p - mu <= delta, p - mu >= -delta)
    w = np.minimum(np.exp(logp - behaviour), cap)
    per_token = -a * w * logp * valid * mask
    return per_token.sum() / mask.sum(), (-a * w * valid * mask) / mask.sum(), valid


def test_dppo_matches_numpy_and_masks_by_the_probability_move():
    settings = PolicyLossSettings(type="dppo", dppo_delta=0.1, dppo_cap=1.5, correction=CorrectionSettings("off"))
    value, grad, terms, _ = temper_loss(settings)
    ref_value, ref_grad, valid = np_dppo(LOGP, SAMPLER, ADV, MASK, 0.1, 1.5)
    counted = MASK > 0
    assert 0 < (~valid & counted).sum() < counted.sum()  # some tokens moved too far, not all
    assert (np.exp(LOGP - SAMPLER)[counted & valid] > 1.5).any()  # and the cap acts on some kept ones
    assert value == pytest.approx(ref_value, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6)
    assert float(terms.clipped_tokens) == (~valid & counted).sum()


def test_a_corrections_metrics_count_what_it_did():
    settings = PolicyLossSettings(correction=CorrectionSettings("sequence_mask", 0.4, 2.5))
    _, _, terms, _ = temper_loss(settings)
    metrics = correction_metrics(terms)
    raw = np.exp(((OLD - SAMPLER) * MASK).sum(1))  # a sequence's ratio
    masked = (raw < 0.4) | (raw > 2.5)
    assert 0 < masked.sum() < len(raw)
    assert metrics["correction/masked_sequences"] == pytest.approx(masked.mean())
    assert metrics["correction/masked_tokens"] == pytest.approx((MASK.sum(1) * masked).sum() / MASK.sum())
    assert metrics["correction/ratio_max"] == pytest.approx(raw.max(), rel=1e-5)
    assert metrics["correction/ratio_min"] == pytest.approx(raw.min(), rel=1e-5)
    assert metrics["correction/truncated_tokens"] == 0.0 and metrics["correction/truncated_sequences"] == 0.0
    # the ratio's token mean before masking: each sequence's ratio counted once per token
    assert metrics["correction/ratio_mean"] == pytest.approx((raw * MASK.sum(1)).sum() / MASK.sum(), rel=1e-5)
    truncating = PolicyLossSettings(correction=CorrectionSettings("token_truncate", None, 1.2))
    _, _, terms, _ = temper_loss(truncating)
    metrics = correction_metrics(terms)
    token_ratio = np.exp(OLD - SAMPLER)
    over = (token_ratio > 1.2) & (MASK > 0)
    assert 0 < over.sum() < MASK.sum()
    assert metrics["correction/truncated_tokens"] == pytest.approx(over.sum() / MASK.sum())
    assert metrics["correction/truncated_sequences"] == pytest.approx(over.any(1).mean())
    assert metrics["correction/ratio_mean"] == pytest.approx((token_ratio * MASK).sum() / MASK.sum(), rel=1e-5)
    assert metrics["correction/masked_tokens"] == 0.0


# ---------------------------------------------------------------- the config


def _cfg(*overrides: str) -> PostTrainConfig:
    return load_config("recipes/configs/grpo_tiny.yml", list(overrides), schema=PostTrainConfig)


def test_the_config_selects_each_objective_and_correction_with_their_defaults():
    s = loss_settings(_cfg("rl.loss.type=cispo", "rl.loss.cispo_cap=4.0"))
    assert (s.type, s.cispo_cap, s.correction.mode, s.correction.hi) == ("cispo", 4.0, "token_truncate", 2.0)
    s = loss_settings(_cfg("rl.loss.type=gmpo"))  # the GMPO paper's clip range, in log space, and its sequence mean
    assert (s.epsilon, s.epsilon_high, s.loss_agg) == (0.4, 0.4, "sequence-mean-token-mean")
    assert loss_settings(_cfg("rl.loss.type=dppo")).correction.mode == "off"  # weighs by the sampler's ratio itself
    assert loss_settings(_cfg("rl.algorithm=gspo")).correction.mode == "geometric_truncate"
    s = loss_settings(_cfg("rl.rollout_correction={mode: sequence_mask, lo: 0.5, hi: 3.0}", "rl.loss.type=sapo"))
    assert (s.type, s.correction) == ("sapo", CorrectionSettings("sequence_mask", 0.5, 3.0))
    # YAML reads a bare `off` as false: the line the docs (and the tis_cap refusal) say to write means the mode off
    assert loss_settings(_cfg("rl.rollout_correction={mode: off}")).correction.mode == "off"
    assert loss_settings(_cfg("rl.rollout_correction.mode=off")).correction.mode == "off"
    # the filled-in defaults are not taken for settings the objective does not read: a config read back loads
    for objective in ("cispo", "sapo", "dppo", "gmpo"):
        for algorithm in ("grpo", "gspo") if objective == "sapo" else ("grpo",):
            cfg = _cfg(f"rl.loss.type={objective}", f"rl.algorithm={algorithm}")
            assert PostTrainConfig.model_validate(cfg.model_dump(mode="json")).rl == cfg.rl


@pytest.mark.parametrize(
    "override,message",
    [
        ("rl.loss.type=ppo2", "unknown rl.loss.type 'ppo2'; known: clip, cispo, sapo, gmpo, dppo"),
        ("rl.rollout_correction.mode=token_clip", "unknown rl.rollout_correction.mode 'token_clip'; known: off, "),
        ("rl.rollout_correction.mode=true", "rl.rollout_correction.mode=True: a name, one of off, token_truncate"),
        ("rl.rollout_correction={mode: token_mask, lo: 2.0, hi: 1.5}", "rl.rollout_correction.lo (2.0) must be <="),
        ("rl.loss.tis_cap=1.5", "rl.loss.tis_cap is now rl.rollout_correction (docs/grpo.md): write "
         "rl.rollout_correction={mode: token_truncate, hi: 1.5}"),
        ("rl.loss.tis_cap=null", "write rl.rollout_correction={mode: off}"),
        ("rl.algorithm=gspo|rl.loss.type=cispo", "rl.loss.type=cispo takes the per-token ratio"),
        ("rl.loss.type=dppo|rl.rollout_correction.mode=token_mask", "would weigh it twice (leave it off)"),
        ("rl.accuracy_fn=llm_judge", "rl.accuracy_fn=llm_judge needs its kwargs"),
        ("rl.loss.type=cispo|rl.loss.epsilon_high=4.0", "rl.loss.type=cispo does not read rl.loss.epsilon_high=4.0; "
         "its own: rl.loss.cispo_cap"),
        ("rl.loss.type=sapo|rl.loss.dual_clip=3.0", "rl.loss.type=sapo does not read rl.loss.dual_clip=3.0"),
        ("rl.loss.type=dppo|rl.loss.epsilon=0.1", "rl.loss.type=dppo does not read rl.loss.epsilon=0.1"),
        ("rl.loss.type=gmpo|rl.loss.loss_agg=token-mean", "rl.loss.type=gmpo is one value a sequence"),
    ],
)  # fmt: skip
def test_bad_names_and_bounds_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        _cfg(*override.split("|"))
    assert message in str(err.value)


def np_objective(kind: str, logp, old, adv, mask, **p):
    """Each objective's per-token loss and its derivative in log pi, written from its paper (token mean over the
    counted tokens): PPO's clip (Schulman et al. 2017), CISPO (MiniMax-M1: the clipped importance weight is a
    constant, the gradient is REINFORCE's on every token), SAPO (Qwen: a sigmoid gate of temperature tau in place
    of the hard clip, 4 / tau scaling so that its slope at r = 1 is the unclipped objective's)."""
    r, a = np.exp(logp - old), adv[:, None] + 0 * logp
    if kind == "clip":
        clipped = np.clip(r, 1 - p["epsilon"], 1 + p["epsilon_high"])
        use_clipped = -a * clipped > -a * r
        per, d = np.where(use_clipped, -a * clipped, -a * r), np.where(use_clipped, 0.0, -a * r)
    elif kind == "cispo":
        w = np.minimum(r, p["cap"])
        per, d = -w * a * logp, -w * a
    else:
        tau = np.where(a > 0, p["tau_pos"], p["tau_neg"])
        gate = 1 / (1 + np.exp(-tau * (r - 1)))
        per, d = -(4 / tau) * gate * a, -4 * gate * (1 - gate) * r * a
    n = mask.sum()
    return (per * mask).sum() / n, d * mask / n


@pytest.mark.parametrize(
    "kind,params,settings",
    [
        ("clip", {"epsilon": 0.2, "epsilon_high": 0.28}, {"type": "clip", "epsilon": 0.2, "epsilon_high": 0.28}),
        ("cispo", {"cap": 1.3}, {"type": "cispo", "cispo_cap": 1.3}),
        ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5}, {"type": "sapo", "sapo_tau_pos": 2.0, "sapo_tau_neg": 0.5}),
    ],
)
def test_clip_cispo_and_sapo_match_numpy_from_their_papers(kind, params, settings):
    s = PolicyLossSettings(loss_agg="token-mean", correction=CorrectionSettings("off"), **settings)
    value, grad, _, _ = temper_loss(s)
    want, want_grad = np_objective(kind, LOGP, OLD, ADV, MASK, **params)
    assert value == pytest.approx(want, abs=2e-6) and np.abs(want_grad).sum() > 0
    np.testing.assert_allclose(grad, want_grad, atol=2e-6)
    assert (ADV > 0).sum() == 3 and (ADV < 0).sum() == 3  # both sides of the clip, the cap and the gate
