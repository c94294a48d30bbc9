"""Offline DPO runs: the pair pipeline, precomputed reference log-probs == live ones, the recipe learning to prefer
the right answer on held-out pairs."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from core.config_loader import config_from_argv
from posttrain.config import PostTrainConfig
from tests.helpers import next_loss_batch

TINY = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.head_dim=16",
    "logging.tensorboard=false",
    "logging.peak_tflops=1.0",
]


def dpo_config(tmp_path, tokenizer, *extra):
    return config_from_argv(
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={tokenizer}",
            "data.num_examples=400",
            "train.batch_size=8",
            "train.micro_batches=2",
            *TINY,
            *extra,
        ],
        "recipes/configs/dpo_tiny.yml",
        schema=PostTrainConfig,
    )


def pairs_of(cfg, tokenizer_dir):
    from transformers import AutoTokenizer

    from core.sources import load_records
    from posttrain.dpo.data import load_pairs

    return load_pairs(cfg, AutoTokenizer.from_pretrained(tokenizer_dir), load_records(cfg.data))


def test_pipeline_covers_every_pair_once_per_epoch_and_packs_the_prompt_once(tmp_path, arithmetic_tokenizer):
    from posttrain.dpo.data import PairLayout, pair_pipeline

    cfg = dpo_config(tmp_path, arithmetic_tokenizer, "data.eval_fraction=0.1")
    data = pairs_of(cfg, arithmetic_tokenizer)
    assert len(data.train) == 360 and len(data.eval) == 40
    assert {p.row for p in data.train}.isdisjoint({p.row for p in data.eval})
    it = iter(pair_pipeline(data.train, batch_size=8, micro_batches=2, layout=PairLayout(128), seed=0))
    seen = []
    for _ in range(45):  # one epoch: 360 pairs
        item = next(it)
        rows = [int(r) for r in item.example_ids]
        seen += rows
        packed = item.batch.packed
        # every pair is one segment: its prompt once (branch 0), then chosen and rejected (branches 1, 2)
        by_row = {p.row: p for p in data.train}
        prompt_tokens = sum(len(by_row[r].prompt) for r in rows)
        seg, branch = np.asarray(packed.segment_ids), np.asarray(packed.branch_ids)
        assert int(((seg > 0) & (branch == 0)).sum()) == prompt_tokens
        assert int(((seg > 0) & (branch > 0)).sum()) == sum(
            len(by_row[r].chosen) + len(by_row[r].rejected) for r in rows
        )
    assert sorted(seen) == sorted(p.row for p in data.train)


def test_precomputed_reference_equals_live(tmp_path, arithmetic_tokenizer):
    """The stored reference log-probs attached to a training batch == the frozen reference scoring that batch
    live (another packing of the same pairs); a second load reads the file; other pairs, or the same path holding
    other weights, recompute."""
    from flax import nnx

    from core.checkpoint_models import initial_model
    from core.mesh import make_mesh
    from posttrain.dpo.data import PairLayout, pair_pipeline
    from posttrain.dpo.objective import with_reference
    from posttrain.dpo.offline import attach_stored, compute_reference_logps
    from posttrain.frozen import FrozenModel
    from posttrain.token_store import TokenStore, tokens_digest, weights_digest

    cfg = dpo_config(tmp_path, arithmetic_tokenizer, "data.eval_fraction=0", "data.num_examples=64")
    data = pairs_of(cfg, arithmetic_tokenizer)
    every = data.train + data.eval
    mesh = make_mesh(cfg.mesh)
    model, cfg = initial_model(cfg, mesh)
    params = nnx.state(model)
    reference = FrozenModel.copy_of(model, mesh, "reference")
    path = tmp_path / "ref.npz"
    digest = tokens_digest((p.row, (p.prompt, p.chosen, p.rejected)) for p in every) + weights_digest(params)
    calls = []

    def compute():
        calls.append(1)
        return compute_reference_logps(every, reference, batch_size=16, layout=PairLayout(128, pack=False))

    store = TokenStore.load_or_compute(path, digest, compute)
    assert len(store.values) == 128 and calls == [1]  # two sequences a pair
    it = iter(pair_pipeline(data.train, batch_size=8, micro_batches=2, layout=PairLayout(128), seed=3))
    for _ in range(3):
        item = next(it)
        live = with_reference(item.batch, reference)
        stored = attach_stored(store, item)
        for a, b in ((live.ref_chosen, stored.ref_chosen), (live.ref_rejected, stored.ref_rejected)):
            a, b = np.asarray(a), np.asarray(b)
            assert (a < -1.0).all()  # real sums of log-probs, not zeros
            np.testing.assert_array_less(np.abs(a - b), 64 * np.spacing(np.abs(a).astype(np.float32)))
    again = TokenStore.load_or_compute(path, digest, compute)
    assert calls == [1] and again.values.keys() == store.values.keys()  # read back, not recomputed
    for key, value in store.values.items():
        np.testing.assert_array_equal(again.values[key], value)
    other_pairs = tokens_digest((p.row, (p.prompt, p.chosen, p.rejected)) for p in every[1:]) + weights_digest(params)
    TokenStore.load_or_compute(path, other_pairs, compute)
    assert calls == [1, 1]  # other pairs: recomputed
    changed = jax.tree.map(lambda x: x * 1.01, params)  # another checkpoint behind the same init_from path
    TokenStore.load_or_compute(path, digest[:64] + weights_digest(changed), compute)
    assert calls == [1, 1, 1]  # other weights: recomputed


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_dpo_recipe_learns_to_prefer_the_right_answer(tmp_path, arithmetic_tokenizer, reference):
    """Pairs whose rejected answer is the right one with a digit appended (a preference a small random model can
    pick up): from policy == reference (held-out loss log 2 at step 0), DPO raises the held-out preference
    accuracy and lowers the held-out loss; the run exports an HF model."""
    from core.run import build_run
    from core.sources import reasoning_gym_records
    from posttrain.dpo.offline import DPO

    rows = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"] + "0"}
        for r in reasoning_gym_records("basic_arithmetic", 400, seed=5, max_digits=2)
    ]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dpo_config(
        tmp_path,
        arithmetic_tokenizer,
        f"data.source={source}",
        "data.eval_fraction=0.1",
        "train.steps=30",
        "train.eval_every=15",
        "train.log_every=5",
        "optim.learning_rate=1e-3",
        f"dpo.precompute_ref_logps={reference == 'precomputed'}",
        "data.columns={}",
    )
    run = build_run(cfg, DPO)
    assert any(note.startswith(f"reference: {reference}") for note in run.parts.notes), run.parts.notes
    run.evaluate(step=0)  # the evaluation at step 0
    run.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert abs(evals[0]["eval/loss"] - math.log(2)) < 1e-5  # policy == reference
    assert evals[-1]["eval/loss"] < 0.4
    assert evals[-1]["eval/rewards/accuracies"] > 0.9
    assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
    if reference == "precomputed":
        assert (tmp_path / "run" / "reference_logps.npz").exists()


def test_reference_free_losses_load_no_reference(tmp_path, arithmetic_tokenizer):
    """simpo and orpo train without a reference: none is built, none is precomputed, the batch carries none."""
    from core.run import build_run
    from posttrain.dpo.offline import DPO

    cfg = dpo_config(
        tmp_path, arithmetic_tokenizer, "dpo.loss_type=simpo", "dpo.precompute_ref_logps=true", "data.num_examples=64"
    )
    run = build_run(cfg, DPO)
    assert any(note.startswith("reference: none") for note in run.parts.notes)
    assert not (tmp_path / "run" / "reference_logps.npz").exists()
    batch = next_loss_batch(run)
    assert batch.ref_chosen is None and batch.ref_rejected is None
    update = run.loop.learner.update(batch, cfg.train.micro_batches)
    assert update.finite and np.isfinite(update.loss)


def test_a_changed_checkpoint_behind_the_same_path_recomputes_the_stored_reference(
    tmp_path, arithmetic_tokenizer, capsys
):
    """`dpo.precompute_ref_logps` through the method as a run builds it: the same run directory and the same
    `init_from` path read the stored values back; another checkpoint written to that path (a re-trained SFT run,
    say) recomputes them, because the store is keyed on the reference's weights, not on the path."""
    import shutil

    from core.run import build_run
    from core.tiny import save_tiny_hf_model
    from posttrain.dpo.offline import DPO

    start = tmp_path / "sft_hf"

    def checkpoint(seed: int):
        shutil.rmtree(start, ignore_errors=True)
        save_tiny_hf_model(start, "qwen2", seed=seed)

    def build():
        cfg = dpo_config(
            tmp_path,
            arithmetic_tokenizer,
            f"checkpoint.init_from={start}",
            "dpo.precompute_ref_logps=true",
            "data.num_examples=32",
            "data.eval_fraction=0",
        )
        return build_run(cfg, DPO)

    checkpoint(seed=0)
    first = build()
    stored = first.loop.source.next().batch
    assert (tmp_path / "run" / "reference_logps.npz").exists()
    capsys.readouterr()
    again = build()
    assert "reference_logps.npz: read 64 sequences' values" in capsys.readouterr().out  # not recomputed
    assert again.loop.source.next().batch.ref_chosen.tolist() == stored.ref_chosen.tolist()
    checkpoint(seed=1)  # other weights, the same path
    changed = build()
    assert "computed for other data or other weights; recomputing" in capsys.readouterr().out
    recomputed = changed.loop.source.next().batch
    assert not np.allclose(recomputed.ref_chosen, stored.ref_chosen)
