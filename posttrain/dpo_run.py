"""Offline DPO: a dataset of preference pairs, the policy trained in the core loop, the reference beside it.

    run = build_dpo(cfg)          # python -m recipes.dpo CONFIG.yml [key=value ...]
    run.trainer.fit()

The policy starts from `checkpoint.init_from` (or a random init, for tests) and
trains with `posttrain.dpo.preference_objective(cfg.dpo)` on the
`core.learner.Learner`, in the `core.loop.Trainer` that pretraining and SFT
use (checkpoints with the data position, exact resume, SIGTERM, NaN policy,
HF export). Pairs come from `posttrain.pair_data`. The reference is the
starting policy, frozen:

- live (default): a `posttrain.frozen.FrozenModel` scores each batch inside
  the timed step;
- `dpo.precompute_ref_logps`: scored once over every pair before the first
  step, stored in `run_dir/reference_logps.npz` (reused on resume) and released.

Reference-free losses (`simpo`, `orpo`) load none. Every `train.eval_every`
steps the held-out pairs give eval/loss, eval/rewards/accuracies (the share
of pairs whose chosen completion gets the higher implicit reward) and
eval/rewards/margins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax

from core.config import Config
from core.config_loader import ConfigError
from core.data import DataBatch
from core.loop import Hook, Trainer
from core.train import batch_shards
from posttrain.dpo import needs_reference, preference_objective, with_reference
from posttrain.pair_data import (
    PairData,
    PairLayout,
    check_pair_source,
    eval_batches,
    load_pairs,
    pair_pipeline,
    pair_texts,
)
from posttrain.pairs import PairBatch
from posttrain.reference_logps import ReferenceLogps, compute_reference_logps, fingerprint

REFERENCE_FILE = "reference_logps.npz"


@dataclass
class DPORun:
    cfg: Config  # with the model section the initial checkpoint decided
    trainer: Trainer
    data: PairData
    tokenizer_dir: str
    reference: str  # "live", "precomputed" or "none"


def reference_origin(cfg: Config) -> str:
    """Where the reference's weights come from (part of the stored log-probs' fingerprint)."""
    start = cfg.checkpoint.init_from
    return f"init_from={Path(start).resolve()}" if start else f"random init, seed {cfg.run.seed}, {cfg.model}"


def build_dpo(cfg: Config) -> DPORun:
    """Everything an offline DPO run trains with, ready to `trainer.fit()`."""
    from transformers import AutoTokenizer

    from core.checkpoint import initial_model
    from core.config import resolve_mesh_shape
    from core.data import load_records
    from core.learner import Learner
    from core.mesh import make_mesh
    from core.metrics import device_memory
    from core.supervised import check_vocab
    from core.tokenizer import tokenizer_for_run
    from posttrain.frozen import FrozenModel

    source = check_pair_source(cfg.data)
    try:
        resolve_mesh_shape(cfg.mesh, jax.device_count())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mesh = make_mesh(cfg.mesh)
    run_dir = Path(cfg.run.run_dir)
    records = load_records(source, cfg.data)
    tokenizer_dir = tokenizer_for_run(cfg.data.tokenizer_dir, pair_texts(records), run_dir, cfg.model.vocab_size)
    data = load_pairs(cfg, AutoTokenizer.from_pretrained(tokenizer_dir), records)
    if data.skipped:
        print(f"skipped {len(data.skipped)} malformed rows; first: {data.skipped[0]}")
    model, cfg = initial_model(cfg, mesh)
    check_vocab(cfg.model.vocab_size, tokenizer_dir)
    learner = Learner(
        model, mesh, preference_objective(cfg.dpo), cfg.optim, total_updates=cfg.train.steps, seed=cfg.run.seed
    )
    layout = PairLayout(cfg.data.seq_len, cfg.data.packing, row_multiple=batch_shards(mesh))
    micro = cfg.train.micro_batches

    # attach(batch, its packing groups) -> the batch with the reference's log-probs (None: reference-free)
    attach: Callable[[DataBatch, int], PairBatch] | None = None
    mode = "none"
    if needs_reference(cfg.dpo):
        # The starting policy, frozen (the learner's parameters before any resume: the Trainer restores later).
        def frozen_start() -> FrozenModel:
            return FrozenModel.copy_of(learner.graphdef, learner.params, mesh, "reference")

        if cfg.dpo.precompute_ref_logps:
            mode = "precomputed"
            # Built only when the stored values are missing or stale, and released once they are computed.
            store = ReferenceLogps.load_or_compute(
                run_dir / REFERENCE_FILE,
                fingerprint(data.all, reference_origin(cfg)),
                lambda: compute_reference_logps(
                    data.all, frozen_start(), batch_size=cfg.train.batch_size, layout=layout
                ),
            )
            attach = lambda d, groups: store.attach(d)
        else:
            mode = "live"
            reference = frozen_start()
            # training batches have one packing group per micro-batch, eval batches one
            attach = lambda d, groups: with_reference(d.batch, reference, groups=groups)

    print(device_memory() + f" (after model init; reference: {mode})")
    train = pair_pipeline(
        data.train,
        batch_size=cfg.train.batch_size,
        micro_batches=micro,
        layout=layout,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )

    def prepare(d: DataBatch, groups: int = micro) -> PairBatch:
        return d.batch if attach is None else attach(d, groups)

    trainer = Trainer(cfg, learner, train, tokenizer_dir=tokenizer_dir, prepare=prepare)
    if data.eval and cfg.train.eval_every:

        def evaluate(trainer: Trainer, step: int) -> None:
            totals: dict[str, float] = {}
            for item in eval_batches(data.eval, batch_size=cfg.train.batch_size, layout=layout):
                loss_sum, sums = trainer.learner.evaluate(prepare(item, 1))
                for k, v in {"loss": loss_sum, **sums}.items():
                    totals[k] = totals.get(k, 0.0) + v
            n = max(totals.pop("loss_denominator"), 1.0)
            trainer.logger.log(step, {f"eval/{k}": v / n for k, v in totals.items()}, console=True)

        trainer.hooks.append(Hook("eval", cfg.train.eval_every, evaluate))
    return DPORun(cfg, trainer, data, tokenizer_dir, mode)


def run_dpo(cfg: Config) -> DPORun:
    """Train to `train.steps` (resuming from `run.run_dir`); returns the finished run."""
    run = build_dpo(cfg)
    run.trainer.fit()
    return run
