"""GRPO building blocks: the RL batch layout, prompts, placement, the sampler group's failure handling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.config_loader import load_config
from core.data import MalformedRow
from posttrain.cluster import placement_bundles
from posttrain.prompts import PromptStream, columns_of, prompt_rows, render_prompt
from posttrain.rl_batch import build_rl_batch
from posttrain.sampling import SamplerGroup
from rollout.sampler import Completion, SamplingParams


def test_rl_batch_layout():
    comps = [Completion([5, 6, 7], [8, 9], [-0.5, -0.25], "stop", "a"),
             Completion([5], [4, 3, 2], [-1.0, -2.0, -3.0], "length", "b"),
             Completion([1, 2], [3], [-0.125], "stop", "c")]
    batch = build_rl_batch(comps, np.array([1.0, -1.0, 0.5]), np.array([True, True, False]), 8, mask_truncated=False)
    np.testing.assert_array_equal(batch["tokens"][0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][1], [1, 1, 1, 1, 0, 0, 0, 0])
    # target t predicts token t+1: row 0's completion tokens are targets 2 and 3
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch["sampler_logp"][0], [0, 0, -0.5, -0.25, 0, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][1], [1, 1, 1, 0, 0, 0, 0])
    assert not batch["loss_mask"][2].any() and batch["completion_mask"][2].sum() == 1  # not kept, still counted
    masked = build_rl_batch(comps, np.zeros(3), np.ones(3, bool), 8, mask_truncated=True)
    assert not masked["loss_mask"][1].any()  # DAPO: truncated completions add no loss tokens
    with pytest.raises(ValueError, match="completion 0: prompt 3 \\+ completion 2 tokens > seq_len 3"):
        build_rl_batch(comps, np.zeros(3), np.ones(3, bool), 3)


def test_prompt_rows_render_and_errors(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(overrides=[f"data.source={src}", "data.eval_fraction=0.1", "rl.prompt_template='Q: {question}'"])
    train, held_out = prompt_rows(cfg)
    assert len(train) == 18 and [r["answer"] for r in held_out] == ["18", "19"]
    assert render_prompt(train[0], cfg.rl) == "Q: q0"
    chat = cfg.rl.model_copy(update={"use_chat_template": True})
    assert render_prompt(train[0], chat) == [{"role": "user", "content": "Q: q0"}]
    assert columns_of(train[:2], 2)["answer"] == ["0", "0", "1", "1"]

    src.write_text(json.dumps({"question": "ok"}) + "\n" + json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(MalformedRow, match=r"row 1: field 'question' \(used by rl.prompt_template\)"):
        prompt_rows(load_config(overrides=[f"data.source={src}"]))
    train, _ = prompt_rows(load_config(overrides=[f"data.source={src}", "data.skip_malformed=true"]))
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
    cfg = load_config(overrides=["rollout.rollout_data_parallelism=2"])
    assert placement_bundles(cfg, {"CPU": 2.0}) == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
    gpu = load_config(overrides=["rollout.rollout_data_parallelism=2", "mesh.trainer_devices_fraction=0.5",
                                 "mesh.sampler_devices_fraction=0.5"])
    assert placement_bundles(gpu, {"CPU": 32, "GPU": 8}) == [{"CPU": 1, "GPU": 4}, {"CPU": 1, "GPU": 2},
                                                              {"CPU": 1, "GPU": 2}]
    with pytest.raises(ValueError, match="cannot place a trainer on 1 GPU"):
        placement_bundles(gpu, {"CPU": 32, "GPU": 1})


class _FakeRemote:
    """A sampler with the Ray client's surface; `dead` makes `result` fail like a killed actor."""

    def __init__(self, tag, dead=False):
        self.tag, self.dead, self.policy_version = tag, dead, 0

    def generate_async(self, prompts, params):
        return list(prompts)

    def result(self, ref):
        if self.dead:
            import ray.exceptions

            raise ray.exceptions.RayActorError()
        return [Completion([], [], None, "stop", f"{self.tag}:{p}") for p in ref]

    def generate(self, prompts, params):
        return self.result(self.generate_async(prompts, params))


def test_sampler_group_restarts_a_dead_sampler_and_keeps_order():
    restarted, synced = [], []

    def restart(i):
        restarted.append(i)
        return _FakeRemote(f"new{i}")

    group = SamplerGroup([_FakeRemote("a"), _FakeRemote("b", dead=True)], restart=restart, resync=synced.append)
    out = group.collect(group.submit(["p0", "p1", "p2", "p3"], SamplingParams()))
    assert [c.text for c in out] == ["a:p0", "a:p1", "new1:p2", "new1:p3"]
    assert restarted == [1] and synced == [group.samplers[1]] and group.restarts == 1
    import ray.exceptions

    no_restart = SamplerGroup([_FakeRemote("c", dead=True)])  # without a restart function the failure surfaces
    with pytest.raises(ray.exceptions.RayActorError):
        no_restart.collect(no_restart.submit(["p"], SamplingParams()))


def _jax_run(tmp_path, tokenizer, *overrides):
    from posttrain.grpo import GRPORun

    cfg = load_config("recipes/configs/grpo_tiny.yml", [
        f"run.run_dir={tmp_path / 'run'}", f"data.tokenizer_dir={tokenizer}", "rollout.sampler=jax",
        "checkpoint.enabled=false", "checkpoint.export_hf=false", "train.steps=2", *overrides])
    return GRPORun(cfg)


@pytest.mark.integration
def test_iterations_and_mini_batches_take_that_many_updates(tmp_path, arithmetic_tokenizer):
    run = _jax_run(tmp_path, arithmetic_tokenizer, "reward.functions=[{fn: tests.reward_plugins:char_count}]",
                   "rl.num_iterations=2", "rl.mini_batches=2", "optim.learning_rate=1.0e-2")
    try:
        seen = []
        run.run(on_step=lambda r, step, m: seen.append(m))
        assert int(run.trainer.target.learner.state.step) == 2 * 2 * 2  # steps x iterations x mini-batches
        # Later updates of a step see a policy that already moved: pi_theta != pi_old, so ratios leave 1.
        assert any(m["clip_fraction"] > 0 for m in seen)
    finally:
        run.close()


@pytest.mark.integration
def test_dynamic_sampling_refills_until_the_round_limit(tmp_path, arithmetic_tokenizer):
    run = _jax_run(tmp_path, arithmetic_tokenizer, "reward.functions=[{fn: tests.reward_plugins:by_prompt_length}]",
                   "rl.dynamic_sampling=true", "rl.max_sampling_rounds=3")
    try:
        seen = []
        run.run(on_step=lambda r, step, m: seen.append(m))
        # No group ever has reward variance: every step draws the maximum rounds, then trains on what it has.
        assert [m["sampling_rounds"] for m in seen] == [3.0, 3.0]
        assert all(m["zero_variance_groups"] == 4 for m in seen)
    finally:
        run.close()


def test_malloc_tunables_add_huge_pages_and_keep_what_is_set():
    from core.host_memory import malloc_tunables

    assert malloc_tunables("") == "glibc.malloc.hugetlb=1"
    assert malloc_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert malloc_tunables("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"  # the user's choice stands
