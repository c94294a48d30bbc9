"""GRPO building blocks: the RL batch layout, prompts, placement, the policy learner's updates (the sampler
group's failure handling: tests/test_sampler_group.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.config_loader import load_config
from core.data import MalformedRow
from core.packing import round_rows
from core.shapes import SizeCache
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.prompts import PromptStream, columns_of, prompt_rows, render_prompt
from posttrain.onpolicy.rl_batch import build_rl_batch
from rollout.placement import placement_bundles
from rollout.sampler import Completion
from tests.helpers import recording_sgd


def test_rl_batch_layout():
    comps = [
        Completion([5, 6, 7], [8, 9], [-0.5, -0.25], "stop", "a"),
        Completion([5], [4, 3, 2], [-1.0, -2.0, -3.0], "length", "b"),
        Completion([1, 2], [3], [-0.125], "stop", "c"),
    ]
    adv, keep = np.array([1.0, -1.0, 0.5]), np.array([True, True, False])
    batch = build_rl_batch(comps, adv, keep, row_len=8, max_tokens=3, pack=False)
    np.testing.assert_array_equal(batch.packed.tokens[0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch.packed.segment_ids[1], [1, 1, 1, 1, 0, 0, 0, 0])
    # completion token j of row i is predicted at position prompt_len - 1 + j of row i
    np.testing.assert_array_equal(batch.packed.target_index[0, :2], [2, 3])
    np.testing.assert_array_equal(batch.packed.target_index[1], [8, 9, 10])
    np.testing.assert_array_equal(batch.loss_mask[0], [1, 1, 0])
    np.testing.assert_array_equal(batch.sampler_logp[0], [-0.5, -0.25, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [1, 1, 1])
    assert not batch.loss_mask[2].any() and batch.packed.target_mask[2].sum() == 1  # not kept, still counted
    masked = build_rl_batch(comps, np.zeros(3), np.ones(3, bool), row_len=8, max_tokens=3, mask_truncated=True)
    assert not masked.loss_mask[1].any()  # DAPO: truncated completions add no loss tokens
    with pytest.raises(ValueError, match="completion 0: prompt 3 \\+ completion 2 tokens > row length 4"):
        build_rl_batch(comps, np.zeros(3), np.ones(3, bool), row_len=4, max_tokens=3)
    with pytest.raises(ValueError, match="completion 1: .*completion 3 > max_tokens 2"):
        build_rl_batch(comps, np.zeros(3), np.ones(3, bool), row_len=8, max_tokens=2)
    with pytest.raises(ValueError, match="3 completions are not divisible into 2 groups"):
        build_rl_batch(comps, np.zeros(3), np.ones(3, bool), row_len=8, max_tokens=3, groups=2)


def test_completions_share_their_prompt():
    """Completions of one prompt share a single copy of it: each completion continues the prompt's positions in
    its own branch, and its first token is predicted from the prompt's last position."""
    comps = [
        Completion([5, 6, 7], [8, 9], [-0.5, -0.25], "stop", ""),
        Completion([5, 6, 7], [4], [-1.0], "stop", ""),
        Completion([1, 2], [3], [-0.125], "stop", ""),
        Completion([1, 2], [6, 6], [-0.1, -0.2], "stop", ""),
    ]
    batch = build_rl_batch(comps, np.zeros(4), np.ones(4, bool), row_len=8, max_tokens=2, groups=2)
    np.testing.assert_array_equal(batch.packed.tokens, [[5, 6, 7, 8, 9, 4, 0, 0], [1, 2, 3, 6, 6, 0, 0, 0]])
    np.testing.assert_array_equal(batch.packed.positions[0], [0, 1, 2, 3, 4, 3, 0, 0])
    np.testing.assert_array_equal(batch.packed.segment_ids[0], [1, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.packed.branch_ids[0], [0, 0, 0, 1, 1, 2, 0, 0])
    np.testing.assert_array_equal(batch.packed.target_index, [[2, 3], [2, 0], [1, 0], [1, 3]])  # local to each group
    np.testing.assert_array_equal(batch.packed.target_ids, [[8, 9], [4, 0], [3, 0], [6, 6]])
    unshared = build_rl_batch(
        comps, np.zeros(4), np.ones(4, bool), row_len=8, max_tokens=2, groups=2, share_prompts=False
    )
    assert (unshared.packed.segment_ids > 0).sum() == 16 and (batch.packed.segment_ids > 0).sum() == 11


@pytest.mark.parametrize("extra_rows,share", [(0, False), (2, False), (0, True), (2, True)])
def test_packed_rl_batch_holds_every_sequence_once(extra_rows, share):
    """Packed rows: each completion sits whole in one row, in the segment of a copy of its prompt (its own
    copy, or with `share` one shared with other completions of the same prompt, cut to fit the row), with
    positions continuing the prompt's; target_index finds the position predicting each of its tokens. Every
    group is self-contained and rows divide evenly, also when `choose_rows` gives a group more rows than it
    needs (a row count compiled before)."""
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 50, rng.integers(1, 9))) for _ in range(8)]
    comps = [
        Completion(prompts[i // 4], list(rng.integers(1, 50, rng.integers(0, 6))), None, "stop", "") for i in range(32)
    ]
    for c in comps:
        c.logprobs = list(-rng.uniform(0, 3, len(c.token_ids)))
    row_len, groups = 16, 4
    batch = build_rl_batch(
        comps,
        np.zeros(32),
        np.ones(32, bool),
        row_len=row_len,
        max_tokens=5,
        groups=groups,
        row_multiple=2,
        choose_rows=lambda n: round_rows(n, 2) + extra_rows,
        share_prompts=share,
    )
    rows = len(batch.packed.tokens)
    assert rows % (groups * 2) == 0 and (extra_rows or rows < 32)  # several sequences share a row
    per_group, seqs = rows // groups, 32 // groups
    for i, c in enumerate(comps):
        g, n, p = i // seqs, len(c.token_ids), len(c.prompt_ids)
        part = slice(g * per_group, (g + 1) * per_group)
        flat, seg, pos, branch = (
            getattr(batch.packed, k)[part].reshape(-1) for k in ("tokens", "segment_ids", "positions", "branch_ids")
        )
        idx = batch.packed.target_index[i, :n]
        np.testing.assert_array_equal(batch.packed.target_ids[i, :n], c.token_ids)
        np.testing.assert_allclose(batch.sampler_logp[i, :n], c.logprobs, rtol=1e-6)
        assert batch.packed.target_mask[i].sum() == n
        if not n:
            continue
        row, segment = idx[0] // row_len, seg[idx[0]]
        assert (idx // row_len == row).all() and segment > 0  # never split across rows
        # token 0 is predicted from the last token of a copy of the prompt, in the same row and segment
        in_copy = (seg == segment) & (branch == 0) & (np.arange(len(seg)) // row_len == row)
        np.testing.assert_array_equal(flat[in_copy], c.prompt_ids)
        np.testing.assert_array_equal(pos[in_copy], np.arange(p))
        assert np.flatnonzero(in_copy)[-1] == idx[0]
        if n > 1:  # token j is predicted from token j - 1: one branch of that segment, positions continuing it
            span = idx[1] + np.arange(n)
            np.testing.assert_array_equal(flat[span], c.token_ids)
            np.testing.assert_array_equal(pos[span], p + np.arange(n))
            assert (seg[span] == segment).all() and len(set(branch[span])) == 1 and branch[span][0] > 0
    completion_tokens = sum(len(c.token_ids) for c in comps)
    prompt_tokens = ((batch.packed.segment_ids > 0) & (batch.packed.branch_ids == 0)).sum()
    assert (batch.packed.branch_ids > 0).sum() == completion_tokens  # no completion token lost or doubled
    if share:  # fewer prompt copies than completions
        assert prompt_tokens < sum(len(c.prompt_ids) for c in comps)
    else:  # one prompt copy per completion
        assert prompt_tokens == sum(len(c.prompt_ids) for c in comps)


def test_round_rows():
    assert [round_rows(n) for n in range(1, 10)] == [1, 2, 3, 4, 6, 6, 8, 8, 12]
    assert [round_rows(n) for n in (13, 17, 33)] == [16, 24, 48]
    assert round_rows(5, multiple=4) == 8 and round_rows(9, multiple=5) == 15


def test_size_cache_reuses_compiled_sizes_within_slack():
    sizes = SizeCache(round_rows)
    assert [sizes.pick(n) for n in (5, 3, 6, 2, 7, 4, 9)] == [6, 6, 6, 2, 8, 6, 12]
    assert sizes.sizes == {2, 6, 8, 12}  # 3 reused 6 (<= 2 x 3); 2 did not (6 > 2 x 2); 4 took the smallest fit
    patient = SizeCache(round_rows, patience=2)
    assert [patient.pick(n) for n in (8, 6, 5, 6, 6, 8)] == [8, 8, 8, 6, 6, 8]  # bucket 6 padded twice, then its own
    assert patient.sizes == {6, 8} and patient.padded == {6: 2}
    with pytest.raises(ValueError, match="smaller than the size needed"):
        SizeCache(lambda n: n - 1).pick(4)
    comps = [Completion([1, 2], [3, 4], None, "stop", "") for _ in range(4)]
    with pytest.raises(ValueError, match=r"choose_rows\(1\) = 3: need at least 1 rows per group, a multiple of 2"):
        build_rl_batch(
            comps, np.zeros(4), np.ones(4, bool), row_len=16, max_tokens=2, row_multiple=2, choose_rows=lambda n: 3
        )


def test_prompt_rows_render_and_errors(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        overrides=[f"data.source={src}", "data.eval_fraction=0.1", "rl.prompt_template='Q: {question}'"],
        schema=PostTrainConfig,
    )
    train, held_out = prompt_rows(cfg)
    assert len(train) == 18 and [r["answer"] for r in held_out] == ["18", "19"]
    assert render_prompt(train[0], cfg.rl) == "Q: q0"
    chat = cfg.rl.model_copy(update={"use_chat_template": True})
    assert render_prompt(train[0], chat) == [{"role": "user", "content": "Q: q0"}]
    assert columns_of(train[:2], 2)["answer"] == ["0", "0", "1", "1"]

    src.write_text(json.dumps({"question": "ok"}) + "\n" + json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(MalformedRow, match=r"row 1: field 'question' \(used by rl.prompt_template\)"):
        prompt_rows(load_config(overrides=[f"data.source={src}"], schema=PostTrainConfig))
    train, _ = prompt_rows(
        load_config(overrides=[f"data.source={src}", "data.skip_malformed=true"], schema=PostTrainConfig)
    )
    assert [r["question"] for r in train] == ["ok"]


def test_prompt_stream_resumes_where_it_stopped():
    rows = [{"question": str(i)} for i in range(10)]
    a = PromptStream(rows, 3, seed=1)
    [next(a) for _ in range(4)]
    state = json.loads(json.dumps(a.get_state()))  # stored in a JSON checkpoint item
    b = PromptStream(rows, 3, seed=1)
    b.set_state(state)
    assert [next(a) for _ in range(3)] == [next(b) for _ in range(3)]


def test_placement_bundles():
    cfg = load_config(overrides=["rollout.rollout_data_parallelism=2"], schema=PostTrainConfig)
    assert placement_bundles(cfg, {"CPU": 2.0}) == ([{"CPU": 1.0}], [{"CPU": 0.5}, {"CPU": 0.5}])
    group = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"trainer_processes": 2})})
    assert placement_bundles(group, {"CPU": 4.0}) == ([{"CPU": 1.0}] * 2, [{"CPU": 1.0}, {"CPU": 1.0}])
    # 2 CPUs for 2 trainer processes and 2 samplers: none to spare, all share evenly
    assert placement_bundles(group, {"CPU": 2.0}) == ([{"CPU": 0.5}] * 2, [{"CPU": 0.5}, {"CPU": 0.5}])
    gpu = load_config(
        overrides=[
            "rollout.rollout_data_parallelism=2",
            "mesh.trainer_devices_fraction=0.5",
            "mesh.sampler_devices_fraction=0.5",
        ],
        schema=PostTrainConfig,
    )
    assert placement_bundles(gpu, {"CPU": 32, "GPU": 8}) == ([{"CPU": 1, "GPU": 4}], [{"CPU": 1, "GPU": 2}] * 2)
    gpu_group = gpu.model_copy(update={"placement": gpu.placement.model_copy(update={"trainer_processes": 4})})
    four = ([{"CPU": 1, "GPU": 1}] * 4, [{"CPU": 1, "GPU": 2}] * 2)
    assert placement_bundles(gpu_group, {"CPU": 32, "GPU": 8}) == four
    with pytest.raises(ValueError, match="in 3 process"):  # 4 GPUs do not split evenly over 3 processes
        placement_bundles(
            gpu.model_copy(update={"placement": gpu.placement.model_copy(update={"trainer_processes": 3})}),
            {"CPU": 32, "GPU": 8},
        )
    with pytest.raises(ValueError, match="cannot place a trainer on 1 GPU"):
        placement_bundles(gpu, {"CPU": 32, "GPU": 1})


def test_malloc_tunables_add_the_host_malloc_and_keep_what_is_set():
    from pathlib import Path

    from core.host_memory import HOST_MALLOC, malloc_tunables

    assert malloc_tunables("") == ":".join(HOST_MALLOC)
    mine = "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"  # the user's choices stand
    assert malloc_tunables(mine).split(":") == [*mine.split(":"), HOST_MALLOC[2], HOST_MALLOC[3]]
    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    assert f"HOST_MALLOC := {':'.join(HOST_MALLOC)}" in makefile.read_text()  # demos and benches use the same


def test_learner_takes_the_same_gradients_on_packed_and_unpacked_rows():
    """The learner's whole step — pi_old and reference passes, 2 iterations x 2 mini-batches x 2 micro-batches,
    the KL on the zero-variance group's tokens too — computes the same loss and gradient at every one of its 4
    updates whether sequences have one row each, share rows, or also share their prompt (compared update by
    update, in float32 steps at each tensor's largest gradient)."""
    import jax

    from core.mesh import single_device_mesh
    from core.method_learner import MethodLearner
    from core.models import create_model
    from posttrain.grpo import GRPO

    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            "rl.batch.num_iterations=2",
            "rl.batch.mini_batches=2",
            "train.micro_batches=2",
            "rl.loss.beta=0.05",
            "rollout.max_tokens=6",
            "train.steps=1",
        ],
        schema=PostTrainConfig,
    )
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, 512, rng.integers(2, 9))) for _ in range(4)]  # 4 prompts x 4 completions
    comps = [
        Completion(
            prompts[i // 4], list(rng.integers(3, 512, rng.integers(1, 7))), list(-rng.uniform(4, 7, 6)), "stop", ""
        )
        for i in range(16)
    ]
    for c in comps:
        c.logprobs = c.logprobs[: len(c.token_ids)]
    adv, keep = rng.normal(size=16), np.arange(16) >= 4
    runs = {}
    for pack, share in ((False, False), (True, False), (True, True)):
        batch = build_rl_batch(
            comps,
            adv,
            keep,
            row_len=32,
            max_tokens=6,
            groups=4,
            pack=pack,
            share_prompts=share,
            kl_keep=np.ones(16, bool),
        )
        assert (batch.packed.branch_ids > 1).any() == share
        mesh = single_device_mesh()
        with jax.set_mesh(mesh):
            model = create_model(cfg.model, mesh, seed=0)
        learner = MethodLearner(cfg, GRPO, model, mesh, tx=recording_sgd(0.1))
        core, updates = learner.learner, []
        update = core.update

        def recorded(batch, micro_batches, core=core, update=update, updates=updates):
            result = update(batch, micro_batches)
            updates.append((result.loss, jax.device_get(core.state.opt_state)))
            return result

        core.update = recorded
        metrics = learner.train(batch).metrics
        assert np.isfinite(metrics["loss"]) and metrics["clip_fraction"] > 0 and len(updates) == 4
        runs[pack, share] = updates
    assert len(build_rl_batch(comps, adv, keep, row_len=32, max_tokens=6, groups=4).packed.tokens) < 16
    for packed in ((True, False), (True, True)):
        for u, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(runs[False, False], runs[packed])):
            assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7), (packed, u)
            for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
                # Measured: <= 10 float32 steps at the first update; later ones start from parameters that already
                # differ by the earlier updates' rounding, <= 68 steps.
                steps = np.abs(a - b).max() / np.spacing(np.float32(np.abs(a).max()))
                assert np.abs(a).max() > 0 and steps <= (32 if u == 0 else 256), (packed, u, steps)
