"""The Bradley-Terry reward model: its scores are what transformers' `...ForSequenceClassification` computes from the
export (within 1e-4), its loss is -log sigmoid(r_chosen - r_rejected - margin) on them, it learns to prefer the
right answer on the tiny recipe, and bad input is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig

RM_TINY = "recipes/configs/reward_model_tiny.yml"


def _learner(*overrides):
    from posttrain.reward_model import REWARD_MODEL
    from tests.helpers import method_learner

    return method_learner(RM_TINY, REWARD_MODEL, "train.steps=4", *overrides)


def _pairs(rng, n=4, eos=2):
    """`n` pairs of random token ids, each completion ending with EOS (as the pair data's do)."""
    from posttrain.dpo.pairs import Pair

    ids = lambda k: tuple(int(x) for x in rng.integers(3, 500, k))
    return [Pair(i, ids(5 + i), (*ids(3 + i % 3), eos), (*ids(4 + i % 2), eos)) for i in range(n)]


def _scores(learner, batch):
    import jax

    from posttrain.reward_model import sequence_scores

    with jax.set_mesh(learner.mesh):
        return np.asarray(jax.jit(sequence_scores)(learner.learner.modules(), batch.packed))


@pytest.mark.parametrize("pack", [True, False])
def test_scores_match_transformers_sequence_classification_and_the_loss_is_bradley_terry(tmp_path, pack):
    import torch
    from transformers import AutoModelForSequenceClassification

    from posttrain.dpo.pairs import build_pair_batch
    from posttrain.reward_model import REWARD_MODEL

    learner, cfg = _learner("optim.learning_rate=1.0e-2", "reward_model.margin=0.5")
    pairs = _pairs(np.random.default_rng(0))
    batch = build_pair_batch(pairs, slots=4, row_len=64, groups=1, pack=pack)
    first = learner.train(batch).metrics  # the zero head's scores: every pair 0 vs 0
    assert first["loss"] == pytest.approx(-np.log(1 / (1 + np.exp(0.5))), rel=1e-5)
    scores = _scores(learner, batch)
    chosen, rejected = scores[0::2], scores[1::2]
    assert np.abs(chosen - rejected).max() > 1e-3  # one update moved the head and the backbone
    second = learner.train(batch).metrics  # its loss is the scores before it: Bradley-Terry with the margin
    expected = np.mean(np.log1p(np.exp(-(chosen - rejected - 0.5))))
    assert second["loss"] == pytest.approx(expected, rel=1e-4)
    assert second["accuracy"] == pytest.approx(np.mean(chosen > rejected))
    assert second["grad_norm"] > 0

    scores = _scores(learner, batch)  # after the second update
    REWARD_MODEL.export_beside(cfg, learner.learner, tmp_path / "hf", None)
    out = tmp_path / "hf" / "reward_model"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    assert hf.config.num_labels == 1
    for i, pair in enumerate(pairs):
        for side, completion in enumerate((pair.chosen, pair.rejected)):
            with torch.no_grad():  # one sequence a call: transformers pools its last token
                theirs = float(hf(torch.tensor([list(pair.prompt + completion)])).logits[0, 0])
            assert scores[2 * i + side] == pytest.approx(theirs, abs=1e-4)


def test_the_output_head_does_not_train_and_the_backbone_does():
    import jax
    from flax import nnx

    from posttrain.dpo.pairs import build_pair_batch

    learner, cfg = _learner("optim.learning_rate=1.0e-2", "model.tie_word_embeddings=false")
    batch = build_pair_batch(_pairs(np.random.default_rng(1)), slots=4, row_len=64, groups=1, pack=True)
    params = lambda: jax.tree.map(np.asarray, nnx.state(learner.learner.modules().model, nnx.Param))  # as they are now
    before = params()
    for _ in range(2):
        learner.train(batch)
    after = params()
    change = lambda part: max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after[part]),
                                                                         jax.tree.leaves(before[part])))  # fmt: skip
    assert change("lm_head") == 0.0 and change("embed") > 0 and change("layers") > 0
    # No score reads the causal LM's head: the trainable filter leaves it out (no gradient buffer, no moments).
    from posttrain.reward_model import REWARD_MODEL

    trained = jax.tree_util.tree_flatten_with_path(nnx.state(learner.learner.modules(), REWARD_MODEL.trainable(cfg)))
    names = [jax.tree_util.keystr(path) for path, _ in trained[0]]
    assert not [n for n in names if "lm_head" in n] and any("value_head" in n for n in names)


def test_a_trained_reward_model_scores_completions_in_the_reward_workers(tmp_path, arithmetic_tokenizer):
    """`reward.functions=[{fn: reward_model, ...}]`: through the real worker pool, batched (right-padded), each
    completion's score equals `transformers`' of that one sequence, encoded as the pairs were (the prompt, then the
    completion and EOS)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from core.encoding import encode_completion, encode_prompt
    from posttrain.dpo.pairs import build_pair_batch
    from posttrain.reward_model import REWARD_MODEL
    from rewards.config import RewardConfig
    from rewards.runner import RewardRunner

    learner, cfg = _learner("optim.learning_rate=1.0e-2")
    batch = build_pair_batch(_pairs(np.random.default_rng(2)), slots=4, row_len=64, groups=1, pack=True)
    for _ in range(2):
        learner.train(batch)
    REWARD_MODEL.export_beside(cfg, learner.learner, tmp_path / "hf", arithmetic_tokenizer)
    path = str(tmp_path / "hf" / "reward_model")
    prompts = ["12 + 7 =", "What is 3 * 4?", "100 - 1", "5 / 5 =", "2 + 2"]
    completions = [" 19", " 12, since 3 * 4 is 12", " 98", " 1", " 4"]
    spec = {"functions": [{"fn": "reward_model", "kwargs": {"path": path, "batch_size": 2}}]}
    runner = RewardRunner(RewardConfig.model_validate(spec), num_procs=1)
    try:
        got = runner.score(prompts, completions).values["reward_model"]
    finally:
        runner.close()
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt, completion, score in zip(prompts, completions, got):
        ids = encode_prompt(tokenizer, prompt) + encode_completion(tokenizer, completion)
        with torch.no_grad():
            assert score == pytest.approx(float(hf(torch.tensor([ids])).logits[0, 0]), abs=1e-4)
    assert np.ptp(got) > 1e-3  # scores the check can tell apart


def test_a_reward_model_that_is_not_one_is_refused_at_load(tmp_path, tiny_hf_dir):
    import shutil

    causal = tiny_hf_dir("qwen2")
    two = tmp_path / "two_labels"
    shutil.copytree(causal, two)
    config = json.loads((two / "config.json").read_text())
    config.update(architectures=["Qwen2ForSequenceClassification"], num_labels=2)
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unknown kwargs batchsize; the reward model takes path, batch_size"):
        load_config(
            "recipes/configs/grpo_tiny.yml",
            [f"reward.functions=[{{fn: reward_model, kwargs: {{path: '{causal}', batchsize: 4}}}}]"],
            schema=PostTrainConfig,
        )
    from posttrain.reward_model import REWARD_MODEL

    with pytest.raises(ConfigError, match="dpo.max_completion_tokens=1: the reward model scores a completion"):
        REWARD_MODEL.check(load_config(RM_TINY, ["dpo.max_completion_tokens=1"], schema=PostTrainConfig))
    cases = {
        str(tmp_path / "nowhere"): "no config.json there",
        str(causal): "not a ...ForSequenceClassification",
        str(two): "its head has 2 outputs; a reward model's is scalar",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(
                "recipes/configs/grpo_tiny.yml",
                [f"reward.functions=[{{fn: reward_model, kwargs: {{path: '{path}'}}}}]"],
                schema=PostTrainConfig,
            )
        assert "reward.functions[0] (reward_model)" in str(err.value) and message in str(err.value)


@pytest.mark.integration
def test_a_reward_model_rewards_a_grpo_run(tmp_path, arithmetic_tokenizer):
    """The exported reward model as GRPO's only reward function (the JAX sampler, 2 steps): each completion's reward
    is the reward model's score of it (transformers, one sequence at a time), none failed, and the policy trains on
    them."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from core.encoding import encode_completion, encode_prompt
    from posttrain.dpo.pairs import build_pair_batch
    from posttrain.grpo import GRPOMethod
    from posttrain.onpolicy.run import build_sampler_run
    from posttrain.reward_model import REWARD_MODEL

    learner, cfg = _learner("optim.learning_rate=1.0e-2")
    batch = build_pair_batch(_pairs(np.random.default_rng(3)), slots=4, row_len=64, groups=1, pack=True)
    for _ in range(2):
        learner.train(batch)
    REWARD_MODEL.export_beside(cfg, learner.learner, tmp_path / "hf", arithmetic_tokenizer)
    path = str(tmp_path / "hf" / "reward_model")
    scored = []

    class Recording(GRPOMethod):
        def from_samples(self, cfg, samples, ctx):
            scored.append(samples)
            return super().from_samples(cfg, samples, ctx)

    grpo = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "rollout.sampler=jax",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
            "train.steps=2",
            "rl.accuracy_fn=null",
            f"reward.functions=[{{fn: reward_model, kwargs: {{path: '{path}', batch_size: 8}}, timeout_s: 120}}]",
        ],
        schema=PostTrainConfig,
    )
    run = build_sampler_run(grpo, Recording())
    seen = []
    try:
        run.train(on_step=lambda r, step, m: seen.append(m))
    finally:
        run.close()
    assert len(seen) == 2 and all(m["reward/reward_model/failure_rate"] == 0.0 and m["grad_norm"] > 0 for m in seen)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    first = scored[0]
    rewards = first.rewards.values["reward_model"]
    assert np.ptp(rewards) > 1e-4  # scores that tell completions apart
    g = grpo.rl.batch.num_generations
    for i in range(0, len(first.completions), 3):  # every third completion, one sequence a call
        prompt = grpo.rl.prompt_template.format(**first.rows[i // g])
        ids = encode_prompt(tokenizer, prompt) + encode_completion(tokenizer, first.completions[i].text)
        with torch.no_grad():
            assert rewards[i] == pytest.approx(float(hf(torch.tensor([ids])).logits[0, 0]), abs=1e-4)


@pytest.mark.integration
def test_the_recipe_learns_to_prefer_the_right_answer_and_exports(tmp_path, arithmetic_tokenizer):
    """150 steps on the arithmetic pairs (the right answer against a near miss) from a random model: the held-out
    Bradley-Terry loss falls from log 2 (every score 0 at the start) and the held-out accuracy from 0 (every pair a
    tie) to well above a coin's; the export reads in transformers."""
    from posttrain.fit import fit
    from posttrain.reward_model import REWARD_MODEL

    cfg = load_config(
        RM_TINY,
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            "checkpoint.enabled=false",
            "train.eval_on_start=true",
        ],
        schema=PostTrainConfig,
    )
    summary = fit(cfg, REWARD_MODEL)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 50, 100, 150]
    assert evals[0]["eval/accuracy"] == 0.0 and evals[0]["eval/loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert evals[150]["eval/accuracy"] > 0.6 and evals[150]["eval/loss"] < 0.64
    train = [r["accuracy"] for r in rows if "accuracy" in r]
    assert np.mean(train[-20:]) > np.mean(train[:20])
    assert (tmp_path / "run" / "hf" / "reward_model" / "config.json").exists() and summary.steps == 150


def test_a_reward_model_gets_a_deadline_that_leaves_room_to_load_it():
    """Without `timeout_s`, a reward model's deadline is its own (300 s), not `reward.math_verify_timeout` (10 s):
    each worker loads the model on its first batch, and a worker killed at the deadline would load it again."""
    from rewards.config import RewardConfig

    functions = [{"fn": "reward_model"}, {"fn": "rewards.model:reward_model"}, {"fn": "math_verify"}]
    cfg = RewardConfig.model_validate({"functions": functions})
    assert [f.timeout_s for f in cfg.functions] == [300.0, 300.0, None]
    mine = RewardConfig.model_validate({"functions": [{"fn": "reward_model", "timeout_s": 60}]})
    assert mine.functions[0].timeout_s == 60.0
