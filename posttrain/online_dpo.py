"""Online DPO: pairs built from the policy's own samples, graded by the reward functions, trained on at once.

    summary = run_online_dpo(cfg)     # python -m recipes.dpo CONFIG.yml dpo.online=true

Each step runs the on-policy loop (`posttrain.onpolicy.loop.OnPolicyRun`:
vLLM samplers on Ray or the JAX sampler, reward functions, weight sync after
every update, evaluation, checkpoints and exact resume): the samplers draw
`rl.batch.num_generations` (k >= 2) completions for each of
`rl.batch.prompts_per_step` prompts, the reward functions score them, and each
prompt gives one pair: its best completion as chosen, its worst as rejected
(the first of equals). A prompt whose completions all score the same carries
no preference and gives none (`pairs/ties`), nor does one where a reward
function failed on any completion (`pairs/failed`). The pairs, each prompt
once with its two completions as branches, train one DPO update
(`posttrain.dpo.preference_objective(cfg.dpo)`, every loss type) against the
starting policy, frozen, as the reference; log-probs are at temperature 1, the
model's own distribution. A step with no pair makes no update.
"""

from __future__ import annotations

import time

import numpy as np
import optax
from jax.sharding import Mesh

from core.config import Config
from core.config_loader import ConfigError
from core.learner import Learner
from posttrain.dpo import needs_reference, preference_objective, with_reference
from posttrain.frozen import FrozenModel
from posttrain.onpolicy.learner import PolicyLearner
from posttrain.onpolicy.loop import OnPolicyRun, RunSummary, StepData, run_to_end
from posttrain.pairs import Pair, PairBatch, build_pair_batch
from rewards.runner import RewardBatch
from rollout.sampler import Completion


def best_worst_pairs(completions: list[Completion], rewards: np.ndarray, k: int) -> tuple[list[Pair], int, int]:
    """(one pair per prompt whose k completions' rewards differ: the first best as chosen, the first worst as
    rejected; prompts left out for a tie; prompts left out for a failed reward, NaN). `Pair.row` is the prompt's
    index in the batch."""
    pairs, ties, failed = [], 0, 0
    for i in range(len(completions) // k):
        scores = np.asarray(rewards[i * k : (i + 1) * k], np.float64)
        if not np.isfinite(scores).all():
            failed += 1
            continue
        best, worst = int(np.argmax(scores)), int(np.argmin(scores))
        if scores[best] == scores[worst]:
            ties += 1
            continue
        chosen, rejected = completions[i * k + best], completions[i * k + worst]
        pairs.append(Pair(i, tuple(chosen.prompt_ids), tuple(chosen.token_ids), tuple(rejected.token_ids)))
    return pairs, ties, failed


class OnlineDPOLearner(PolicyLearner):
    """The policy and the frozen reference (none for reference-free losses); one update per step."""

    def __init__(
        self, cfg: Config, model, mesh: Mesh, total_steps: int, tx: optax.GradientTransformation | None = None
    ):
        super().__init__(cfg, mesh)
        self.learner = Learner(
            model, mesh, preference_objective(cfg.dpo), cfg.optim, total_updates=total_steps, seed=cfg.run.seed, tx=tx
        )
        self.reference = (
            FrozenModel.copy_of(self.learner.graphdef, self.learner.params, mesh, "reference")
            if needs_reference(cfg.dpo)
            else None
        )

    def train(self, batch: PairBatch) -> dict[str, float]:
        micro = self.cfg.train.micro_batches
        start = time.perf_counter()
        if self.reference is not None:
            batch = with_reference(batch, self.reference, groups=micro)
        metrics = self.learner.update(batch, micro)
        self._applied(metrics, f"online DPO step {self.version + 1}")
        self.version += 1
        out = {k: v for k, v in metrics.items() if k not in ("finite", "empty", "tokens")}
        out.update(
            skipped_updates=float(self.skipped_updates),
            empty_updates=float(self.empty_updates),
            **{"time/update_s": time.perf_counter() - start},
        )
        return out


class OnlineDPORun(OnPolicyRun):
    learner_class = OnlineDPOLearner

    def __init__(self, cfg: Config):
        check_online_config(cfg)
        super().__init__(cfg)

    def _prepare(self, rows: list[dict], completions: list[Completion], rewards: RewardBatch, correct) -> StepData:
        k = self.cfg.rl.batch.num_generations
        pairs, ties, failed = best_worst_pairs(completions, rewards.total, k)
        metrics = {"pairs": float(len(pairs)), "pairs/ties": float(ties), "pairs/failed": float(failed)}
        batch = None
        if pairs:
            batch = build_pair_batch(
                pairs,
                slots=self.cfg.rl.batch.prompts_per_step,
                row_len=self.row_len,
                groups=self.cfg.train.micro_batches,
                pack=self.cfg.rl.batch.pack_sequences,
                row_multiple=self.row_multiple,
            )
        return StepData(batch, completions, rewards, correct, metrics)

    def _method_line(self, m: dict) -> str:
        return f"pairs {m['pairs']:.0f} (ties {m['pairs/ties']:.0f}) | pref acc {m.get('rewards/accuracies', 0):.3f}"


def check_online_config(cfg: Config) -> None:
    b = cfg.rl.batch
    if b.num_generations < 2:
        raise ConfigError(
            f"online DPO picks the best and worst of rl.batch.num_generations >= 2, not {b.num_generations}"
        )
    if b.dynamic_sampling or b.num_iterations != 1 or b.mini_batches != 1:
        raise ConfigError(
            "online DPO makes one update per step: rl.batch.dynamic_sampling=false, num_iterations=1, "
            f"mini_batches=1 (got {b.dynamic_sampling}, {b.num_iterations}, {b.mini_batches})"
        )
    if b.prompts_per_step % cfg.train.micro_batches:
        raise ConfigError(
            f"rl.batch.prompts_per_step={b.prompts_per_step} is not divisible by train.micro_batches="
            f"{cfg.train.micro_batches}"
        )


def run_online_dpo(cfg: Config) -> RunSummary:
    return run_to_end(OnlineDPORun(cfg))
