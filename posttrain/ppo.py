"""PPO with a critic: a value model beside the policy, GAE advantages, the clipped value loss.

    summary = fit(cfg, PPO)         # python -m recipes.ppo [recipes/configs/ppo_tiny.yml] [key=value ...]

A `posttrain.onpolicy.policy_gradient.PolicyGradient` method (the samplers, rewards, weight sync, the clipped
policy objective `rl.loss.*`, `rl.batch.num_iterations` x `mini_batches` updates: everything GRPO trains with),
whose module tree (`PPOModules`) holds two trainable parts: the policy and its critic, a copy of the policy's
starting weights (LoRA adapters included) or another causal LM (`ppo.critic_init_from`), with a scalar value head
(zeros: every value starts at 0).
What is PPO's own, as verl's and OpenRLHF's PPO do it:

- the batch (`from_samples`): each completion's reward (the reward functions' total) on its last sampled token;
  a completion a reward function failed on trains not at all;
- attached in the trainer before the updates (`attach`): the critic's values V_t of the state before each
  sampled token, then GAE over each completion's sampled tokens (`gae`: delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lambda A_{t+1}; the episode ends after its last sampled token, V = 0 there; tokens an
  environment wrote are not steps and are skipped), returns A_t + V_t, advantages whitened over the step's
  tokens (`ppo.whiten_advantages`);
- the loss: the policy objective plus the clipped value loss (`value_loss`: 0.5 max((V - R)^2, (clip(V, V_old -
  c, V_old + c) - R)^2), `ppo.value_clip` c), each over the same tokens (`rl.loss.loss_agg=token-mean`);
- the optimizers (`optimizer`, `core.optim.by_part`): one per part, each clipped by its own gradient's norm: the
  critic's at `ppo.critic_learning_rate`, the policy's at optim's and held for the first
  `ppo.critic_warmup_steps` steps (the critic learns its values first; the policy's moments and schedule start at
  its first update);
- one checkpoint holds both parts (the module tree's trainable state); the run's end exports the policy to
  `run_dir/hf` and the critic apart, to `run_dir/hf/critic`, as a Hugging Face token-classification model with one
  label (its `score` head), which `transformers.AutoModelForTokenClassification` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from core.config_loader import ConfigError
from core.learner import Learner
from core.method import Attach, TrainStats
from core.models import Decoder, ModuleTree
from core.models.lora import trainable_filter
from core.optim import by_part, held_for, make_optimizer, part_of
from core.sums import summed
from core.train import LossOutput, Update
from posttrain.advantages import Advantages
from posttrain.config import PostTrainConfig
from posttrain.critic import Critic, ValuePass, check_critic_source, critic_for, export_critic
from posttrain.frozen import grouped_logprobs
from posttrain.onpolicy.method import SampleContext
from posttrain.onpolicy.policy_gradient import PolicyGradient, UpdateSums, loss_settings, policy_objective, rl_batch
from posttrain.onpolicy.rl_batch import RLBatch
from posttrain.onpolicy.step import Scored, StepData

# ------------------------------------------------------------------ the maths (pure)


def gae(rewards: Any, values: Any, mask: Any, gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns), each [B, T], of per-token `rewards` and `values` over the steps `mask` marks (1: a
    sampled token). The step after token t is the next marked token; after a row's last one the episode has ended
    (its value is 0). Unmarked tokens read 0."""
    rewards, values, mask = (jnp.asarray(x, jnp.float32) for x in (rewards, values, mask))

    def step(carry, t):  # backwards over the tokens
        next_value, next_adv = carry
        r, v, m = rewards[:, t], values[:, t], mask[:, t] > 0
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
        return carry, jnp.where(m, adv, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), jnp.arange(rewards.shape[1] - 1, -1, -1))
    advantages = adv[::-1].T  # [B, T]
    return advantages, (advantages + values) * (mask > 0)


def value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, clip: float | None
) -> tuple[jax.Array, jax.Array]:
    """(the clipped value loss summed over `mask`'s tokens, how many of them the clip decided)."""
    unclipped = jnp.square(values - returns)
    if clip is None:
        return 0.5 * (unclipped * mask).sum(), jnp.zeros((), jnp.float32)
    clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
    clipped = jnp.square(clipped_values - returns)
    return 0.5 * (jnp.maximum(unclipped, clipped) * mask).sum(), ((clipped > unclipped) * mask).sum()


def whiten(x: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """`x` less its mean, over its standard deviation, both over `mask`'s entries (0 elsewhere)."""
    m = mask > 0
    if not m.any():
        return np.zeros_like(x)
    mean, std = x[m].mean(), x[m].std()
    return np.where(m, (x - mean) / (std + eps), 0.0).astype(np.float32)


def last_token_rewards(rewards: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[B, T]: each row's reward on its last marked token (0 elsewhere, and on a row with none)."""
    out = np.zeros(mask.shape, np.float32)
    rows = np.nonzero(mask.any(axis=1))[0]
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
    out[rows, last[rows]] = rewards[rows]
    return out


# ------------------------------------------------------------------ the module tree


class PPOModules(ModuleTree):
    """The policy (`.model`, what samples, syncs and exports) and its critic, each trained."""

    def __init__(self, model: Decoder, critic: Critic):
        super().__init__(model)
        self.critic = critic


# ------------------------------------------------------------------ the batch and the loss


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PPOBatch(RLBatch):
    """A rollout batch with each completion's reward ([B]); the trainer attaches the critic's values before the
    step and the GAE returns (`old_values`, `returns`: [B, C]; `advantages` are GAE's)."""

    rewards: Any = None
    old_values: Any = None
    returns: Any = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PPOSums:
    policy: UpdateSums
    value_loss: Any = summed()
    value_clipped: Any = summed()
    value_tokens: Any = summed()


def ppo_objective(cfg: PostTrainConfig):
    """loss_fn(PPOModules, PPOBatch, rng) -> the policy objective's LossOutput plus the clipped value loss."""
    policy = policy_objective(loss_settings(cfg), cfg.rollout.temperature or 1.0)
    clip = cfg.ppo.value_clip

    def loss_fn(modules: PPOModules, batch: PPOBatch, rng: jax.Array | None) -> LossOutput:
        out = policy(modules.model, batch, rng)
        mask = batch.loss_mask.astype(jnp.float32)
        values = modules.critic.values(batch.packed, rng)
        v_sum, v_clipped = value_loss(values, batch.old_values, batch.returns, mask, clip)
        return LossOutput(out.total + v_sum, out.denominator, PPOSums(out.sums, v_sum, v_clipped, mask.sum()))

    return loss_fn


# ------------------------------------------------------------------ the method


class PPOMethod(PolicyGradient):
    """The policy-gradient update with a critic's GAE advantages and its clipped value loss (module docstring)."""

    name = "PPO"

    def check(self, cfg: PostTrainConfig) -> None:
        if not cfg.reward.functions and cfg.rl.agent is None:  # an environment's rewards are rewards too
            raise ConfigError("PPO needs reward.functions (at least one reward function to score completions)")
        if cfg.rl.loss.loss_agg != "token-mean":
            raise ConfigError(
                f"PPO sums its value loss over the policy loss's tokens: rl.loss.loss_agg must be token-mean, not "
                f"{cfg.rl.loss.loss_agg!r}"
            )
        if cfg.rl.batch.dynamic_sampling:
            raise ConfigError(
                "rl.batch.dynamic_sampling drops groups whose rewards do not vary (GRPO's advantages): PPO's "
                "advantages come from its critic, so set rl.batch.dynamic_sampling=false"
            )
        if cfg.model.moe is not None:
            raise ConfigError("PPO's critic is a dense model: model.moe is not offered with PPO yet")
        check_critic_source(cfg.ppo.critic_init_from)
        updates = cfg.rl.batch.mini_batches * cfg.train.micro_batches
        if (cfg.rl.batch.prompts_per_step * cfg.rl.batch.num_generations) % updates:
            raise ConfigError(
                f"rl.batch.prompts_per_step * rl.batch.num_generations must be divisible by rl.batch.mini_batches * "
                f"train.micro_batches ({updates})"
            )

    # ------------------------------------------------------------------ what trains

    def modules(self, cfg: PostTrainConfig, model: Decoder, mesh: Mesh) -> PPOModules:
        """The policy and its critic: a copy of the policy's starting weights, or `ppo.critic_init_from`'s model
        (its own shape; its vocabulary must hold the policy's token ids)."""
        return PPOModules(model, critic_for(cfg, model, mesh))

    def trainable(self, cfg: PostTrainConfig) -> Any:
        """The policy's own (every parameter, or its LoRA adapters); the critic's backbone's (the same filter for
        a copy of the policy; every parameter for one from `ppo.critic_init_from`) but its output head, which no
        value reads; the value head."""
        critic = trainable_filter(cfg.model) if cfg.ppo.critic_init_from is None else nnx.Param
        unread = nnx.All(nnx.PathContains("critic"), nnx.PathContains("lm_head"))
        return nnx.Any(
            nnx.All(nnx.PathContains("model"), trainable_filter(cfg.model)),
            nnx.All(nnx.PathContains("critic"), critic, nnx.Not(unread)),
            nnx.PathContains("value_head"),
        )

    def loss(self, cfg: PostTrainConfig):
        return ppo_objective(cfg)

    def optimizer(self, cfg: PostTrainConfig, total_updates: int, params: nnx.State) -> optax.GradientTransformation:
        """An optimizer for each part, as verl's actor and critic: the critic's at `ppo.critic_learning_rate`, the
        policy's at optim's, held for `ppo.critic_warmup_steps` steps (its moments and its schedule start at its
        first update), each clipped at `optim.grad_clip_norm` by its own gradient's norm."""
        missing = [part for part in ("model", "critic") if part not in params]
        if missing:  # optim.trainable_regex left a part with nothing to train
            raise ConfigError(
                f"PPO trains the policy (`model.`) and the critic (`critic.`): optim.trainable_regex "
                f"{cfg.optim.trainable_regex!r} leaves {' and '.join(missing)} with no parameter"
            )
        policy_from = cfg.ppo.critic_warmup_steps * self.updates_per_step(cfg)
        critic_rate = cfg.ppo.critic_learning_rate or cfg.optim.learning_rate
        critic_optim = cfg.optim.model_copy(update={"learning_rate": critic_rate})
        policy = make_optimizer(cfg.optim, max(total_updates - policy_from, 1), part_of(params, "model"))
        critic = make_optimizer(critic_optim, total_updates, part_of(params, "critic"))
        return by_part({"model": held_for(policy, policy_from), "critic": critic})

    # ------------------------------------------------------------------ a step

    def attach(self, cfg: PostTrainConfig, learner: Learner) -> Attach:
        return CriticValues(cfg, learner, super().attach(cfg, learner), ValuePass())

    def report(self, cfg: PostTrainConfig, updates: list[Update], attached: dict[str, float]) -> TrainStats:
        policy = super().report(cfg, [_policy_part(u) for u in updates], attached)
        sums = [u.sums for u in updates]
        tokens = max(sum(float(s.value_tokens) for s in sums), 1.0)
        value = {
            "value_loss": sum(float(s.value_loss) for s in sums) / tokens,
            "value_clip_fraction": sum(float(s.value_clipped) for s in sums) / tokens,
        }
        return TrainStats({**policy.metrics, **value}, f"{policy.line} | vf {value['value_loss']:.4f}")

    def from_samples(self, cfg: PostTrainConfig, scored: Scored, ctx: SampleContext) -> StepData:
        assert scored.rewards is not None  # PPO has reward functions (checked)
        total = np.asarray(scored.rewards.total, np.float32)
        ok = np.isfinite(total)
        adv = Advantages(np.zeros_like(total), ok, ok, 0, int((~ok).sum()))
        batch = rl_batch(cfg, scored.completions, adv, ctx.row_len, ctx.row_multiple)
        fields = {f: getattr(batch, f) for f in RLBatch.__dataclass_fields__}
        ppo = PPOBatch(**fields, rewards=np.where(ok, total, 0.0).astype(np.float32))
        return StepData(ppo, scored, {"reward/failed": float(adv.failed_groups)})

    def export_beside(self, cfg: PostTrainConfig, learner: Learner, hf_dir: Path, tokenizer_dir: str | None) -> None:
        """The critic, to `hf_dir/critic`: its backbone as the policy's family writes it, with a one-label
        token-classification head (`score`), as `transformers` reads a value model."""
        export_critic(cast(PPOModules, learner.modules()).critic, hf_dir, tokenizer_dir)


def _policy_part(update: Update) -> Update:
    """The update with the policy objective's sums alone (what `PolicyStats` reads)."""
    import dataclasses

    return dataclasses.replace(update, sums=update.sums.policy)


@dataclass
class CriticValues:
    """What PPO attaches to a batch: the critic's values, GAE's advantages and returns, then the policy update's
    own values (pi_old, the reference); the values' and returns' means and how much of the returns the values
    explain."""

    cfg: PostTrainConfig
    learner: Learner
    policy: Attach
    value_pass: ValuePass

    def __call__(self, batch: PPOBatch) -> tuple[RLBatch, dict[str, float]]:
        critic = cast(PPOModules, self.learner.modules()).critic
        mask = np.asarray(batch.loss_mask) > 0
        values = grouped_logprobs(self.value_pass, cast(Any, critic), batch.packed, self.learner.mesh) * mask
        rewards = last_token_rewards(np.asarray(batch.rewards), mask)
        p = self.cfg.ppo
        adv, returns = (np.asarray(x) for x in gae(rewards, values, mask, p.gamma, p.lam))
        metrics = {
            "value/mean": float(values[mask].mean()) if mask.any() else 0.0,
            "returns/mean": float(returns[mask].mean()) if mask.any() else 0.0,
            "value/explained_variance": explained_variance(values[mask], returns[mask]),
        }
        if p.whiten_advantages:
            adv = whiten(adv, mask)
        ready = batch.replace(advantages=adv.astype(np.float32), old_values=values, returns=returns)
        ready, attached = self.policy(ready)
        return ready, {**attached, **metrics}


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """1 - Var(returns - values) / Var(returns) (0 when the returns do not vary)."""
    var = float(np.var(returns)) if returns.size else 0.0
    return 0.0 if var == 0.0 else 1.0 - float(np.var(returns - values)) / var


PPO = PPOMethod()
