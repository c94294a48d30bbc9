"""Distillation's parts around the objective: a padded teacher's vocabulary read over the student's, the dump's store
gathered through packing and micro-batches, and what is refused at start or at the batch."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from core.config import OptimConfig
from core.data import to_data_batch
from core.learner import Learner
from core.models import create_model
from posttrain.distill.objective import DistillModules, DistillSettings, distill_objective
from tests.test_distill_objective import STUDENT, TEACHER, V, full_logits, log_softmax, make_batch, mesh, rows


def test_a_padded_teachers_logprobs_are_read_over_the_students_vocabulary():
    """On-policy's teacher pass (`FrozenModel.load(vocab=V)`): log-probs normalised over the first V rows."""
    from posttrain.frozen import LogprobPass

    padded = create_model(TEACHER.model_copy(update={"vocab_size": V + 8}), None, seed=1)
    packed = to_data_batch(rows(seed=5), 1).batch
    zt = full_logits(padded, packed)[..., :V]
    got = np.asarray(LogprobPass(1.0, vocab=V)(padded, packed))
    mask = np.asarray(packed.target_mask) > 0
    want = np.take_along_axis(log_softmax(zt), np.asarray(packed.target_ids)[..., None], -1)[..., 0]
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    full = np.asarray(LogprobPass(1.0)(padded, packed))
    assert np.abs(full[mask] - want[mask]).max() > 1e-3  # the padding rows do move the unrestricted values


def test_the_store_gathers_each_targets_topk_through_packing_and_micro_batches(tmp_path, arithmetic_tokenizer):
    """A dump whose top-1 at every target is that target's own token: gathered for packed rows (several
    conversations a row) in two micro-batches, every slot's top-1 is the token the slot predicts."""
    from core.config import DataConfig
    from core.data import load_tokenizer, make_pipeline, tokenize_examples
    from core.sources import reasoning_gym_records
    from posttrain.distill.method import _token_at
    from posttrain.distill.topk_store import DumpHeader, DumpPlan, TopKStore, start_dump, write_shard
    from posttrain.sft import row_format

    cfg = DataConfig(format="chat", seq_len=256, packing=True, shuffle=True)
    records = reasoning_gym_records("basic_arithmetic", 120, seed=3)
    tokenizer = load_tokenizer(arithmetic_tokenizer)
    examples = tokenize_examples(records, row_format("chat", True), tokenizer, cfg)
    data = dict(format="temper-topk-v1", tokenizer="t", seq_len=256, truncation_side="right", source="s")
    header = DumpHeader(k=3, dtype="float16", temperature=1.0, teacher="", vocab_size=512, rows_per_shard=50,
                        data_format="chat", **data)  # fmt: skip
    plan = DumpPlan.of(header, examples)
    assert start_dump(tmp_path, plan, examples) == [0, 1, 2]
    for i, shard in enumerate(plan.shards):
        ids, counts = [], []
        for r in shard:
            ex = examples.by_row[r]
            targets = ex.tokens[np.asarray(ex.targets) > 0]
            ids.append(np.stack([targets, (targets + 1) % 512, (targets + 2) % 512], 1))
            counts.append(len(targets))
        ids = np.concatenate(ids)
        write_shard(tmp_path, plan, i, examples, ids, np.log(np.full(ids.shape, 0.3)), counts)
    store = TopKStore.open(tmp_path, {**data, "data_format": "chat"}, 512, examples)
    batches = iter(make_pipeline(examples, cfg, 8, micro_batches=2))
    seen = 0
    for _ in range(3):
        d = next(batches)
        packed = d.batch
        per_row = [len(set(row.tolist()) - {-1}) for row in np.asarray(d.example_ids)]
        assert max(per_row) > 1, per_row  # packed: several conversations a row
        got, logp = store.gather(d.example_ids, np.asarray(packed.positions), _token_at(packed, 2))
        mask = np.asarray(packed.target_mask) > 0
        np.testing.assert_array_equal(got[..., 0][mask], np.asarray(packed.target_ids)[mask])
        np.testing.assert_allclose(logp[mask], np.log(0.3), rtol=1e-3)  # float16 on disk
        assert not got[~mask].any()
        seen += int(mask.sum())
    assert seen > 300


def test_feature_layers_a_model_lacks_are_refused_at_start_naming_the_pair():
    """`feature_projections_for` (built with the module tree, before any step): each pair's layers against both
    models' ranges; the projections replicated on the mesh, none when the widths agree."""
    from core.config_loader import ConfigError
    from posttrain.config import PostTrainConfig
    from posttrain.distill.method import feature_projections_for

    teacher = create_model(TEACHER, None, seed=1)

    def config(pairs):
        d = dict(regime="online", teacher="t", feature_layers=pairs, feature_weight=1.0)
        return PostTrainConfig.model_validate({"model": STUDENT.model_dump(), "distill": d})

    with pytest.raises(
        ConfigError, match=r"distill.feature_layers\[1\] = \[1, 3\]: the teacher has layers 1..2, not 3"
    ):
        feature_projections_for(config([[1, 2], [1, 3]]), mesh(), teacher)
    with pytest.raises(
        ConfigError, match=r"distill.feature_layers\[0\] = \[2, 1\]: the student has layers 1..1, not 2"
    ):
        feature_projections_for(config([[2, 1]]), mesh(), teacher)
    projections = feature_projections_for(config([[1, 2], [1, 1]]), mesh(), teacher)
    assert [k[...].shape for k in projections.kernels] == [(32, 48), (32, 48)]
    assert projections.kernels[0][...].sharding.is_fully_replicated
    same_width = create_model(TEACHER.model_copy(update={"hidden_size": 32}), None, seed=1)
    assert feature_projections_for(config([[1, 1]]), mesh(), same_width) is None


def test_a_batch_packed_for_other_micro_batches_reads_other_rows_and_is_refused():
    """The GKD bug the packing-group count closes: completions packed for `mini_batches * micro_batches` = 2 groups
    but updated in 1 micro-batch. Forced through (the old path), the second group's targets index the first
    group's rows and the loss changes; packed for the micro-batches it trains in, 1 or 2 groups give the same loss.
    The learner now refuses the mismatch, naming both counts."""
    from core.batch import with_groups
    from posttrain.distill.onpolicy import check_config as gkd_check
    from posttrain.onpolicy.rl_batch import build_rl_batch
    from rollout.sampler import Completion

    rng = np.random.default_rng(9)
    prompts = [list(rng.integers(3, V, 5)) for _ in range(4)]
    comps = [Completion(p, list(rng.integers(3, V, 6)), [0.0] * 6, "stop", "") for p in prompts for _ in range(2)]

    def batch(groups):
        packed = build_rl_batch(comps, np.zeros(8), np.ones(8, bool), row_len=32, max_tokens=6, groups=groups).packed
        return make_batch(packed, 0.5, 1.0)

    settings = DistillSettings(kind="forward", top_k=0)
    from posttrain.distill.objective import trainable

    def loss(b, micro):
        learner = Learner(
            DistillModules(create_model(STUDENT, None, seed=0), teacher=create_model(TEACHER, None, seed=1)),
            mesh(),
            distill_objective(settings, STUDENT),
            OptimConfig(name="sgd", learning_rate=0.0, schedule="constant"),
            total_updates=1,
            trainable=trainable(nnx.Param),
        )
        update = learner.update(b, micro)
        assert update.applied and update.denominator == 48  # every target of the 8 completions, counted
        return update.loss

    right = loss(batch(1), 1)
    assert loss(batch(2), 2) == pytest.approx(right, rel=1e-6)
    wrong = loss(with_groups(batch(2), 1), 1)  # what GKD did with rl.batch.mini_batches=2, train.micro_batches=1
    assert abs(wrong - right) > 1e-2
    with pytest.raises(ValueError, match=r"packed for 2 packing group\(s\) but is split into 1 micro-batch"):
        loss(batch(2), 1)
    # and GKD itself packs for its micro-batches, refusing a mini-batch schedule it does not run
    from core.config_loader import ConfigError, load_config
    from posttrain.config import PostTrainConfig

    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        ["distill.teacher=.", "distill.on_policy_loss=gkd", "rl.batch.mini_batches=2"],
        schema=PostTrainConfig,
    )
    with pytest.raises(ConfigError, match="gkd makes one update a step"):
        gkd_check(cfg)
