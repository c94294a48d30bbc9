"""The LLM judge (`rewards.judge`): its parsers, its refusals at config load, a verdict it cannot read or an engine
that does not answer failing the completion (NaN, counted), never a stand-in 0; and, on a real vLLM engine on Ray
through the reward runner, each completion's value is the parser's reading of the greedy verdict transformers
generates for the same templated prompt."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig
from rewards.judge import Judge, parser_of

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nCorrect answer: {answer}\nScore:"


def test_parsers_read_numbers_yes_no_regexes_and_functions():
    number, yes_no = parser_of("number"), parser_of("yes_no")
    assert number("I give it 7.5.") == 7.5 and number("no digits") is None
    for ambiguous in ("8/10", "7 out of 10", "on a scale of 1-5: 4", "I give it 7, no, 8.5"):
        assert number(ambiguous) is None, ambiguous  # which number is the score? unread, not guessed
    assert yes_no(" Yes, it is") == 1.0 and yes_no("no.") == 0.0 and yes_no("NO") == 0.0
    for neither in ("maybe", "Not sure", "Nothing to say", "Now, let us see", "None", "Yesterday it was"):
        assert yes_no(neither) is None, neither
    regex = parser_of(r"Score:\s*(\d+)")
    assert regex("... Score: 4 (of 5)") == 4.0 and regex("Score: x") is None
    assert parser_of("tests.reward_plugins:verdict_chars")("abc") == 3.0


class Engine:
    """A stand-in engine (this is a unit test of the judge's own logic; the real engine is below)."""

    def __init__(self, replies=None, error=None):
        self.replies, self.error, self.asked, self.stopped = replies, error, [], False

    def stop(self):
        self.stopped = True

    def generate(self, requests, params):
        from rollout.sampler import Completion

        self.asked.append((requests, params))
        if self.error is not None:
            raise self.error
        return [Completion([], [], None, "stop", r) for r in self.replies]


def _judge(engine, template=TEMPLATE, **kwargs):
    judge = Judge("unused", template, **kwargs)
    judge._engine = engine
    return judge


def test_an_unreadable_verdict_or_an_engine_that_does_not_answer_fails_the_completion():
    engine = Engine(["Score: 3", "I cannot tell", "Score: inf", "Score: 1"])
    judge = _judge(engine, parser=r"Score:\s*(\S+)")
    values, messages = judge.score(["1+1", "2+2", "3+3", "4+4"], [" 2", " 5", " 6", " 8"], {"answer": [2, 4, 6, 8]})
    assert values == [3.0, None, None, 1.0]  # no stand-in value for what the parser could not read
    assert messages and "2 verdicts the parser could not read" in messages[0]
    requests, params = engine.asked[0]
    assert requests[1] == "Question: 2+2\nAnswer:  5\nCorrect answer: 4\nScore:"  # the row's columns fill it
    assert params.temperature == 0.0 and params.seed == 0
    chat = _judge(Engine(["Score: 1"]), parser="number", chat=True)
    chat.score(["q"], [" a"], {"answer": [1]})
    assert chat._engine.asked[0][0][0][0]["role"] == "user"  # the template as a user turn
    from ray.exceptions import GetTimeoutError

    unfilled = _judge(Engine(["Score: 1"]), template="{completion} against {reference}")
    values, messages = unfilled.score(["q"], [" a"], {"answer": [1]})  # a slot no column fills: it fails, counted
    assert values == [None] and "cannot be filled from the rows (KeyError: 'reference'; columns: answer)" in messages[0]
    hung = Engine(error=GetTimeoutError("no answer in 120 s"))
    silent = _judge(hung)
    values, messages = silent.score(["q", "r"], [" a", " b"], {"answer": [1, 2]})
    assert values == [None, None] and "did not answer: GetTimeoutError" in messages[0]
    assert hung.stopped and silent._engine is None  # the engine that holds the lost call is stopped: a new one next


def test_the_runner_counts_a_judges_failures_as_failed_items():
    from rewards.config import RewardConfig
    from rewards.runner import RewardRunner

    spec = {"functions": [{"fn": "llm_judge", "kwargs": {"model": "unused", "template": TEMPLATE}}]}
    runner = RewardRunner(RewardConfig.model_validate(spec), num_procs=1)
    engine = Engine(["Score: 5", "nothing"])
    try:
        runner.served["llm_judge"] = _judge(engine)
        batch = runner.score(["a", "b"], [" 1", " 2"], {"answer": [1, 2]})
    finally:
        runner.close()
    assert engine.stopped  # the runner stops the judge's engine
    assert batch.values["llm_judge"][0] == 5.0 and math.isnan(batch.total[1]) and batch.failed["llm_judge"][1]
    assert batch.metrics()["reward/llm_judge/failure_rate"] == 0.5


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ("{model: m, template: 'Rate {prompt}'}", "kwargs.template has no {completion} slot"),
        ("{model: m, template: '{completion}', parser: 'Score: \\d+'}", "a regex needs a group around the number"),
        ("{template: '{completion}'}", "kwargs.model: the judge's model"),
        ("{model: m, template: '{completion}', parser: 'nowhere.module:fn'}", "kwargs.parser='nowhere.module:fn'"),
        ("{model: m, template: '{completion}', timeout: 60}", "unknown kwargs timeout; the judge takes model,"),
        ("{model: m, template: '{completion}', engine: {dtpe: bfloat16}}", "kwargs.engine (rollout.* keys"),
    ],
)
def test_a_judge_config_that_cannot_work_is_refused_at_load(kwargs, message):
    with pytest.raises(ConfigError) as err:
        load_config(
            "recipes/configs/grpo_tiny.yml", [f"reward.functions=[{{fn: llm_judge, kwargs: {kwargs}}}]"],
            schema=PostTrainConfig,
        )  # fmt: skip
    assert "reward.functions[0] (llm_judge)" in str(err.value) and message in str(err.value)


@pytest.mark.integration
@pytest.mark.serial
def test_a_judge_on_a_real_vllm_engine_scores_what_transformers_greedy_verdict_says(rollout_model_dir):
    import ray
    from transformers import AutoTokenizer

    from rewards.config import RewardConfig
    from rewards.runner import RewardRunner
    from rollout.ray import ensure_ray
    from tests.test_jax_sampler import hf_greedy

    path = str(rollout_model_dir("llama"))
    kwargs = {"model": path, "template": TEMPLATE, "parser": "tests.reward_plugins:verdict_chars", "max_tokens": 8}
    ensure_ray(num_cpus=2)
    runner = RewardRunner(RewardConfig.model_validate({"functions": [{"fn": "llm_judge", "kwargs": kwargs}]}))
    prompts, completions, answers = ["12 + 7", "3 * 4", "9 - 1"], [" 19", " 11", " 8"], ["19", "12", "8"]
    try:
        got = runner.score(prompts, completions, {"answer": answers}).values["llm_judge"]
    finally:
        runner.close()
        ray.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt, completion, answer, value in zip(prompts, completions, answers, got):
        text = TEMPLATE.format(prompt=prompt, completion=completion, answer=answer)
        verdict = tokenizer.decode(hf_greedy(path, tokenizer(text).input_ids, 8), skip_special_tokens=True)
        assert value == float(len(verdict))
    assert np.isfinite(got).all()


@pytest.mark.integration
@pytest.mark.serial
def test_a_judge_rewards_grpo_on_a_bfloat16_vllm_sampler_whose_mismatch_a_token_mask_acts_on(
    tmp_path, arithmetic_tokenizer, rollout_model_dir
):
    """GRPO on Ray with the vLLM sampler in bfloat16 (the trainer in float32), rewarded by an LLM judge on its own
    vLLM engine (the tiny Llama; the verdict's length as the parser's reading): every completion gets the judge's
    value (none fails), every step trains. The sampler's bfloat16 log-probs are not the trainer's, and the rollout
    correction (a token mask) drops the tokens whose ratio left its bounds: some, not all."""
    import json

    from posttrain.grpo import GRPO
    from tests.helpers import step_metrics

    judge = {"model": str(rollout_model_dir("llama")), "template": TEMPLATE, "max_tokens": 8}
    judge["parser"] = "tests.reward_plugins:verdict_chars"
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            f"run.run_dir={tmp_path / 'run'}",
            f"data.tokenizer_dir={arithmetic_tokenizer}",
            f"reward.functions=[{{fn: llm_judge, kwargs: {json.dumps(judge)}}}]",
            "rl.accuracy_fn=null",
            "rollout.dtype=bfloat16",
            "rl.rollout_correction={mode: token_mask, lo: 0.99, hi: 1.01}",
            "train.steps=2",
            "train.eval_every=0",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
        ],
        schema=PostTrainConfig,
    )
    seen = step_metrics(cfg, GRPO, on_ray=True)
    print({k: v for k, v in seen[-1].items() if k.startswith(("correction/", "mismatch/", "reward/"))})
    assert len(seen) == 2
    for m in seen:
        assert m["reward/llm_judge/failure_rate"] == 0.0 and m["reward/failed_groups"] == 0
        assert np.isfinite(m["reward/llm_judge/mean"]) and m["reward/std"] > 0  # the verdicts differ
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
        assert m["mismatch/logp_gap_mean"] > 1e-4  # bfloat16 sampling: the mismatch is real
    masked = [m["correction/masked_tokens"] for m in seen]
    assert all(0 < x < 1 for x in masked), masked
