"""Adaptive entropy control (`rl.loss.entropy_target`): the coefficient's steps as TRL's `use_adaptive_entropy`
takes them (applied only while the last entropy was at or below the target; raised by delta when at or below it,
lowered when above, within the range), the coefficient the batch carries reaching the loss, its state kept by a
checkpoint of the sampler source, and the config's refusals."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig
from posttrain.losses.entropy_control import EntropyControl
from posttrain.losses.policy import PolicyLossSettings, policy_loss


def test_the_coefficient_moves_toward_the_target_within_its_range():
    control = EntropyControl(coef=0.01, target=1.0, lo=0.0, hi=0.03, delta=0.01)
    applied, coefs = [], []
    for entropy in [0.5, 0.4, 0.9, 1.5, 2.0, 2.5, 0.8, float("nan")]:
        applied.append(control.applied())
        control.update(entropy)
        coefs.append(control.coef)
    # before the first step nothing was measured: no bonus; then the bonus applies while entropy <= target
    assert applied == pytest.approx([0.0, 0.02, 0.03, 0.03, 0.0, 0.0, 0.0, 0.01])
    assert coefs == pytest.approx([0.02, 0.03, 0.03, 0.02, 0.01, 0.0, 0.01, 0.01])  # clipped to [0, 0.03]; NaN: no step
    again = EntropyControl.from_state(control.state())
    assert again == control and again.applied() == control.applied()


def test_the_batchs_coefficient_is_the_one_the_loss_uses():
    rng = np.random.default_rng(0)
    logp, old = -rng.uniform(0.1, 2, (3, 5)), -rng.uniform(0.1, 2, (3, 5))
    adv, mask, entropy = rng.normal(size=3), np.ones((3, 5)), rng.uniform(0.5, 2, (3, 5))
    args = (jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
    fixed = policy_loss(*args, PolicyLossSettings(entropy_coef=0.2), entropy=jnp.asarray(entropy))[0]
    adaptive = PolicyLossSettings(entropy_adaptive=True)
    carried = policy_loss(*args, adaptive, entropy=jnp.asarray(entropy), entropy_coef=jnp.float32(0.2))[0]
    none = policy_loss(*args, adaptive, entropy=jnp.asarray(entropy), entropy_coef=jnp.float32(0.0))[0]
    assert float(carried) == pytest.approx(float(fixed), rel=1e-6)
    assert float(none) - float(carried) == pytest.approx(0.2 * entropy.mean() * mask.sum(), rel=1e-5)


class _Method:
    def plots(self, cfg):
        return ()


def _cfg(*overrides: str) -> PostTrainConfig:
    return load_config("recipes/configs/grpo_tiny.yml", list(overrides), schema=PostTrainConfig)


def test_a_checkpoint_of_the_sampler_source_keeps_the_controllers_state():
    from posttrain.onpolicy.prompts import PromptStream
    from posttrain.onpolicy.rollouts import SingleTurn
    from posttrain.onpolicy.source import SamplerSource

    cfg = _cfg("rl.loss.entropy_target=0.5", "rl.loss.entropy_coef_range=[0.0, 0.1]", "rl.loss.entropy_coef=0.02")
    rows = [{"question": str(i)} for i in range(8)]

    def source():
        stream = PromptStream(rows, 2, seed=0)
        return SamplerSource(cfg, _Method(), None, None, SingleTurn(cfg.rl), stream, None, (), 64, 1)  # type: ignore[arg-type]

    first = source()
    assert first.entropy is not None and first.entropy.applied() == 0.0 and first.entropy.coef == 0.02
    first.entropy.update(0.3)
    meta, _ = first.checkpoint()
    resumed = source()
    resumed.restore(1, meta)
    assert resumed.entropy == first.entropy and resumed.entropy.applied() == pytest.approx(0.025)
    assert math.isinf(source().entropy.last)  # a fresh run starts with nothing measured


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rl.loss.entropy_target=0.3"], "rl.loss.entropy_target=0.3 needs rl.loss.entropy_coef_range"),
        (["rl.loss.entropy_coef_range=[0.0, 0.1]"], "toward rl.loss.entropy_target: set one"),
        (["rl.loss.entropy_target=0.3", "rl.loss.entropy_coef_range=[0.2, 0.1]"], "needs 0 <= lo <= hi"),
    ],
)
def test_an_entropy_target_without_a_range_is_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert message in str(err.value)


def test_the_grpo_step_reads_the_coefficient_its_batch_carries():
    """The step's loss function (what the trainer runs, not `policy_loss` alone) takes the coefficient from the
    batch: the same batch carrying 0.5 instead of 0 lowers the loss by 0.5 x its mean entropy x its denominator."""
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.rl_batch import build_rl_batch
    from rollout.sampler import Completion
    from tests.helpers import method_learner

    adaptive = ("rl.loss.entropy_target=1.0", "rl.loss.entropy_coef_range=[0.0, 1.0]")
    learner, cfg = method_learner("recipes/configs/grpo_tiny.yml", GRPO, *adaptive)
    rng = np.random.default_rng(0)
    comps = [Completion([5, 6, 7], [int(t) for t in rng.integers(3, 500, 6)], [-6.0] * 6, "stop", "") for _ in range(4)]
    batch = build_rl_batch(comps, np.linspace(-1, 1, 4), np.ones(4, bool), row_len=32, max_tokens=8, groups=1)
    loss_fn = GRPO.loss(cfg)
    model = learner.learner.model()
    out = {}
    for coef in (0.0, 0.5):
        carried = batch.replace(entropy_coef=np.full(np.shape(batch.advantages), coef, np.float32))
        out[coef] = loss_fn(model, carried, None)
    tokens = float(out[0.0].sums.terms.completion_tokens)
    mean_entropy = float(out[0.0].sums.entropy) / tokens
    drop = float(out[0.0].total) - float(out[0.5].total)
    assert mean_entropy > 0 and drop == pytest.approx(0.5 * mean_entropy * float(out[0.0].denominator), rel=1e-4)
