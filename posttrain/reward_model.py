"""A Bradley-Terry reward model trained on preference pairs: the policy's architecture with a scalar head.

    run = build_run(cfg, REWARD_MODEL)     # python -m recipes.reward_model CONFIG.yml [key=value ...]
    run.fit()                              # run_dir/hf/reward_model: a ...ForSequenceClassification directory

The model reads a sequence (the prompt, then a completion) and scores it by a linear head on the final hidden
state of its last token, as `transformers`' `...ForSequenceClassification` pools (its last token: a completion
ends with EOS, or the template's end of turn). The loss is Bradley-Terry's, with an optional margin
(`reward_model.margin`, Llama 2's):

    loss = -log sigmoid(r(prompt, chosen) - r(prompt, rejected) - margin)     averaged over the pairs

The pairs are offline DPO's (`posttrain.dpo.data`: the same rows, formats, truncation and packing, chosen and
rejected as two branches after one copy of the prompt); the model starts from `checkpoint.init_from` (a causal LM:
its output head is left out of training, and written with the backbone, where `...ForSequenceClassification` does
not read it) with a zero head, so every score starts at 0. Every
`train.eval_every` steps the held-out pairs give eval/loss and eval/accuracy (the share whose chosen completion
scores higher). The run's end writes the reward model to `run_dir/hf/reward_model`, which
`transformers.AutoModelForSequenceClassification` reads, and which `reward.functions` takes
(`rewards.model:reward_model`) to score an on-policy method's completions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from core.batch import PackedBatch
from core.config_loader import ConfigError
from core.learner import Learner
from core.method import Method
from core.models import Decoder, ModuleTree
from core.models.lora import trainable_filter
from core.run import MethodParts, RunContext, check_rows
from core.sums import summed
from core.train import LossOutput
from posttrain.config import PostTrainConfig
from posttrain.critic import export_scored, scalar_head
from posttrain.dpo.data import PAIR_FORMATS, example_pair_batch, pair_source, pair_texts
from posttrain.dpo.pairs import PairBatch


class RewardModules(ModuleTree):
    """The backbone (`.model`) and its scalar head (`.value_head`)."""

    def __init__(self, model: Decoder, mesh: Mesh, seed: int):
        super().__init__(model)
        self.value_head = scalar_head(model.cfg.hidden_size, mesh, seed)


def last_token_index(packed: PackedBatch) -> jax.Array:
    """[S] the flat row position of each scored sequence's last token: the token after the state that predicts
    its last target. (A completion holds at least two tokens, its text and its end token, so its last one sits
    right after its predecessor in its branch.)"""
    mask = packed.target_mask > 0  # [S, C]
    last = jnp.maximum(mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1), 0)  # the last real target's column
    return jnp.take_along_axis(packed.target_index, last[:, None], axis=1)[:, 0] + 1


def sequence_scores(modules: RewardModules, packed: PackedBatch, rng: jax.Array | None = None) -> jax.Array:
    """[S] the head's score of every scored sequence's last token's final hidden state."""
    hidden, _ = modules.model.layer_states(
        packed.tokens, packed.positions, packed.segment_ids, packed.branch_ids, compact=packed.compact, rng=rng
    )
    flat = hidden.reshape(-1, hidden.shape[-1])
    last = flat[last_token_index(packed)].astype(jnp.float32)  # [S, D]
    return modules.value_head(last)[:, 0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PreferenceSums:
    """What the Bradley-Terry loss sums per pair besides itself (a `core.sums` record)."""

    accuracy: Any = summed("accuracy")  # the chosen completion scored higher
    margin: Any = summed("score_margin")  # r(chosen) - r(rejected)
    chosen: Any = summed("score_chosen")
    rejected: Any = summed("score_rejected")


def bradley_terry(margin: float):
    """loss_fn(modules, PairBatch, rng) -> LossOutput: -log sigmoid(r_c - r_r - margin), summed over the real
    pairs, divided by their count."""

    def loss_fn(modules: RewardModules, batch: PairBatch, rng: jax.Array | None) -> LossOutput:
        scores = sequence_scores(modules, batch.packed, rng)  # [2P]: chosen, rejected, ...
        chosen, rejected = scores[0::2], scores[1::2]
        real = batch.pair_mask.astype(jnp.float32)
        gap = chosen - rejected
        loss = -jax.nn.log_sigmoid(gap - margin) * real
        sums = PreferenceSums(
            ((gap > 0) * real).sum(), (gap * real).sum(), (chosen * real).sum(), (rejected * real).sum()
        )
        return LossOutput(loss.sum(), real.sum(), sums)

    return loss_fn


class BradleyTerryRewardModel(Method[PairBatch]):
    name = "reward model"

    def check(self, cfg: PostTrainConfig) -> None:
        check_rows(cfg, "the reward model", PAIR_FORMATS)
        if cfg.dpo.max_completion_tokens is not None and cfg.dpo.max_completion_tokens < 2:
            raise ConfigError(
                f"dpo.max_completion_tokens={cfg.dpo.max_completion_tokens}: the reward model scores a completion at "
                "its last token, after at least one other (its text, then its end token): keep 2 or more"
            )

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]:
        return pair_texts(records)

    def modules(self, cfg: PostTrainConfig, model: Decoder, mesh: Mesh) -> RewardModules:
        return RewardModules(model, mesh, cfg.run.seed)

    def trainable(self, cfg: PostTrainConfig) -> Any:
        """The backbone's parameters (its LoRA adapters, with `model.lora`) but its output head, which no score
        reads; the scalar head."""
        unread = nnx.PathContains("lm_head")
        return nnx.Any(
            nnx.All(nnx.PathContains("model"), trainable_filter(cfg.model), nnx.Not(unread)),
            nnx.PathContains("value_head"),
        )

    def loss(self, cfg: PostTrainConfig):
        return bradley_terry(cfg.reward_model.margin)

    def parts(self, run: RunContext) -> MethodParts:
        source = pair_source(run.cfg, run.tokenizer, run.records, run.row_multiple)
        console = {"accuracy": "acc", "eval/accuracy": "eval acc", "score_margin": "margin"}
        return MethodParts(
            source.train, source.evaluation, skipped=source.data.skipped, notes=source.notes, console=console
        )

    def export_beside(self, cfg: PostTrainConfig, learner: Learner, hf_dir: Path, tokenizer_dir: str | None) -> None:
        """The reward model, to `hf_dir/reward_model`: the backbone as its family writes it, with a one-label
        sequence-classification head (`score`)."""
        modules = cast(RewardModules, learner.modules())
        export_scored(
            modules.model, modules.value_head, hf_dir / "reward_model", tokenizer_dir, "ForSequenceClassification"
        )

    def example_batch(self, cfg: PostTrainConfig, row_multiple: int) -> PairBatch:
        return example_pair_batch(cfg, row_multiple)


REWARD_MODEL = BradleyTerryRewardModel()
