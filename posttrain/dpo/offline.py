"""Offline DPO: a dataset of preference pairs, the policy trained in the core loop, the reference beside it.

    run = build_run(cfg, DPO)          # python -m recipes.dpo CONFIG.yml [key=value ...]
    run.fit()

A `core.method.Method`: the policy starts from `checkpoint.init_from` (or a random init, for tests) and trains with
`posttrain.dpo.objective.preference_objective(cfg.dpo)` in the `core.train_loop.TrainLoop` every dataset method uses
(checkpoints with the data position, exact resume, SIGTERM, NaN policy, HF export). Pairs come from
`posttrain.dpo.data`. The reference is the starting policy, frozen:

- live (default): a `posttrain.frozen.FrozenModel` scores each batch inside the timed step (`attach`, beside the
  trainer, as online DPO's);
- `dpo.precompute_ref_logps`: scored once over every pair before the first step into
  `run_dir/reference_logps.npz` (a `posttrain.token_store.TokenStore`: every target's log-prob, keyed by pair row
  and side; reused on resume while the pairs' tokens and the reference's weights are the same) and released.

Reference-free losses (`simpo`, `orpo`) load none. Every `train.eval_every` steps the held-out pairs give
eval/loss, eval/rewards/accuracies (the share of pairs whose chosen completion gets the higher implicit reward),
eval/rewards/margins and the other means the objective sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from flax import nnx

from core.batch_source import Prepare, as_is
from core.data import DataBatch
from core.learner import Learner
from core.method import Attach, Method, unchanged
from core.models.adapters import adapters_off
from core.run import MethodParts, RunContext, check_rows
from core.train import LossFn
from core.trainer import Trainer
from posttrain.config import PostTrainConfig
from posttrain.dpo.data import (
    PAIR_FORMATS,
    PairLayout,
    eval_batches,
    example_pair_batch,
    pair_source,
    pair_texts,
)
from posttrain.dpo.objective import live_reference, needs_reference, preference_objective
from posttrain.dpo.pairs import Pair, PairBatch
from posttrain.frozen import FrozenModel
from posttrain.token_store import Key, TokenStore, tokens_digest, weights_digest

REFERENCE_FILE = "reference_logps.npz"


def pair_keys(example_ids: np.ndarray) -> list[Key | None]:
    """The store keys of a pair batch's scored sequences, in its order: slot i's chosen (row, 0), rejected (row, 1)."""
    return [key for row in example_ids for key in (((int(row), 0), (int(row), 1)) if row >= 0 else (None, None))]


def compute_reference_logps(
    pairs: Sequence[Pair], reference: FrozenModel, *, batch_size: int, layout: PairLayout
) -> dict[Key, np.ndarray]:
    """Every target's log-prob under the reference, for both sides of every pair, `batch_size` pairs a pass."""
    out: dict[Key, np.ndarray] = {}
    for n, item in enumerate(eval_batches(pairs, batch_size=batch_size, layout=layout)):
        logp = reference.logprobs(item.batch.packed)  # [2P, C]
        counts = np.asarray(item.batch.packed.target_mask).sum(axis=1).astype(int)
        for k, key in enumerate(pair_keys(item.example_ids)):
            if key is not None:
                out[key] = logp[k, : counts[k]].astype(np.float32)
        if (n + 1) % 20 == 0 or len(out) == 2 * len(pairs):
            print(f"reference log-probs: {len(out) // 2}/{len(pairs)} pairs", flush=True)
    return out


def reference_store(trainer: Trainer, path: Path, pairs: Sequence[Pair], batch_size: int, layout: PairLayout) -> str:
    """Where the trainer is (`core.trainer.Trainer.apply`; every process of a group computes, the first writes):
    the starting policy's reference log-probs of `pairs` at `path`, read when it holds them for these pairs and
    these weights, or computed (the frozen reference built only then, and released after) and stored there. Returns
    the store's digest: the run reads the store from `path` (the run directory every process sees), so the values
    do not cross between processes."""
    model = trainer.model()
    digest = tokens_digest((p.row, (p.prompt, p.chosen, p.rejected)) for p in pairs)
    digest += weights_digest(nnx.state(adapters_off(model)))  # the reference's weights
    TokenStore.load_or_compute(
        path,
        digest,
        lambda: compute_reference_logps(
            pairs, FrozenModel.start_of(trainer.learner.learner), batch_size=batch_size, layout=layout
        ),
    )
    return digest


def attach_stored(store: TokenStore, data: DataBatch[PairBatch]) -> PairBatch:
    """`data`'s pair batch with the stored reference log-probs of its pairs, summed per side (0 for an empty slot)."""
    batch = data.batch
    width = int(np.asarray(batch.packed.target_mask).shape[1])
    seq = store.gather(pair_keys(np.asarray(data.example_ids)), width).sum(axis=1)
    return batch.replace(ref_chosen=seq[0::2].astype(np.float32), ref_rejected=seq[1::2].astype(np.float32))


class OfflineDPO(Method):
    name = "DPO"

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]:
        return pair_texts(records)

    def loss(self, cfg: PostTrainConfig) -> LossFn:
        return preference_objective(cfg.dpo)

    def attach(self, cfg: PostTrainConfig, learner: Learner) -> Attach[PairBatch]:
        """The live reference's log-probs on each batch; none when they are stored (`parts` gathers them by pair
        from the store) or the loss is reference-free."""
        return unchanged if cfg.dpo.precompute_ref_logps else live_reference(cfg.dpo, learner)

    def parts(self, run: RunContext) -> MethodParts:
        cfg = run.cfg
        source = pair_source(cfg, run.tokenizer, run.records, run.row_multiple)
        data, layout, notes = source.data, source.layout, source.notes

        prepare: Prepare = as_is
        if not needs_reference(cfg.dpo):
            notes.append(f"reference: none (dpo.loss_type={cfg.dpo.loss_type} is reference-free)")
        elif cfg.dpo.precompute_ref_logps:
            # Where the trainer is, from the starting policy (before any resume restores: the loop restores later).
            path, every = Path(cfg.run.run_dir) / REFERENCE_FILE, data.train + data.eval
            # One pass over every pair: in a process group, each batch's pass within a call's timeout.
            passes = -(-len(every) // cfg.train.batch_size)
            timeout_s = cfg.placement.call_timeout_s * max(passes, 1)
            digest = run.trainer.apply(reference_store, path, every, cfg.train.batch_size, layout, timeout_s=timeout_s)
            store = TokenStore.load(path, digest)
            if store is None:  # the trainer wrote it where this process does not see it
                raise RuntimeError(f"{path}: not the reference store the trainer wrote; run.run_dir must be shared")
            prepare = lambda d, groups: attach_stored(store, d)
            notes.append(f"reference: precomputed ({REFERENCE_FILE}, {_reference_kind(cfg)})")
        else:  # attached beside the trainer (`attach`)
            notes.append(f"reference: live ({_reference_kind(cfg)})")

        # the share of pairs whose chosen completion gets the higher implicit reward, in training and held out
        console = {"rewards/accuracies": "pref acc", "eval/rewards/accuracies": "eval pref acc"}
        return MethodParts(
            source.train, source.evaluation, prepare=prepare, skipped=data.skipped, notes=notes, console=console
        )

    def example_batch(self, cfg: PostTrainConfig, row_multiple: int) -> PairBatch:
        """`train.batch_size` pairs of a third of `data.seq_len` each (`example_pair_batch`), with the reference's
        log-probs the loss reads."""
        batch = example_pair_batch(cfg, row_multiple)
        zeros = np.zeros(cfg.train.batch_size, np.float32)
        return batch.replace(ref_chosen=zeros, ref_rejected=zeros) if needs_reference(cfg.dpo) else batch


def _reference_kind(cfg: PostTrainConfig) -> str:
    if cfg.model.lora is not None:
        return "the policy with its LoRA adapters off"
    return "the starting policy, frozen"


DPO = OfflineDPO()


def check_config(cfg: PostTrainConfig) -> None:
    check_rows(cfg, "DPO", PAIR_FORMATS)
