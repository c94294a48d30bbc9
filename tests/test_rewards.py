"""Rewards: the built-ins against a hand-written table, adversarial completions, misbehaving plugins, the registry."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from core.config_loader import ConfigError, load_config
from posttrain.config import PostTrainConfig
from rewards.config import RewardConfig
from rewards.gsm8k import gsm8k
from rewards.mathverify import math_verify
from rewards.registry import BUILTINS, UnknownReward, canonical, resolve
from rewards.runner import RewardRunner
from rewards.shaping import format as format_reward
from rewards.shaping import length_penalty, overlong

PLUGINS = "tests.reward_plugins"

# (gold, completion, expected) for math_verify with its defaults (1 = equal, 0 = not).
MATH_VERIFY_CASES = [
    ("72", "so the answer is \\boxed{72}", 1.0),
    ("72", "\\boxed{72.0}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),  # fraction vs decimal
    ("\\frac{1}{2}", "The answer is <answer>0.5</answer>", 1.0),  # solution tags
    ("1/3", "\\boxed{0.333}", 0.0),  # a rounded decimal is not the fraction
    ("1234", "\\boxed{1,234}", 1.0),  # thousands separator
    ("1234", "We get 1,234 apples in total", 1.0),  # last number, separator, unit word
    ("5", "it costs \\boxed{5 \\text{ dollars}}", 1.0),  # units inside the box
    ("18", "<answer>18</answer>", 1.0),
    ("18", "<answer>19</answer>", 0.0),
    ("18", "first 18, then 20", 0.0),  # the last number counts
    ("18", "no numbers here", 0.0),  # nothing to extract
    ("3", "\\boxed{3} and later 4", 1.0),  # a box beats the last number
    ("0", "0/0", 0.0),  # math-verify alone judges an unboxed 0/0 equal to 0; undefined never matches
    ("0", "\\boxed{\\frac{0}{0}}", 0.0),
    ("0", "\\boxed{0}", 1.0),
    ("2", "\\boxed{\\sqrt{4}}", 1.0),  # symbolic equality
    ("-7", "the result is -7.", 1.0),  # negative, trailing full stop
    ("1000000", "\\boxed{10^6}", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "\\boxed{72}", 1.0),  # GSM8K gold with ####
    ("3", "\\boxed{" + "1" * 300 + "}", 0.0),  # longer than max_answer_chars
    ("2.5", "\\boxed{5/2}", 1.0),
]

F = "<reasoning>r</reasoning><answer>{}</answer>"

# (gold, completion, expected) for gsm8k with its defaults: format term + answer term (see rewards/gsm8k.py).
GSM8K_CASES = [
    ("72", F.format("72"), 3.0 + 3.0),  # exact format, exact answer
    ("72", F.format(" 72 "), 3.0 + 1.5),  # whitespace
    ("1234", F.format("1,234"), 3.0 + 1.5),  # thousands separator
    ("72", F.format("$72"), 3.0 + 1.5),  # currency sign
    ("72", F.format("72.0"), 3.0 + 1.5),  # decimal form
    ("7.50", F.format("7.5"), 3.0 + 1.5),
    ("5", F.format("5 apples"), 3.0 + 1.5),  # unit word
    ("72", F.format("70"), 3.0 + 0.5),  # ratio 0.97: high partial credit
    ("72", F.format("60"), 3.0 + 0.25),  # ratio 0.83: low partial credit
    ("72", F.format("10"), 3.0 - 1.0),  # wrong number
    ("3", F.format("-3"), 3.0 - 1.0),
    ("72", F.format("seventy-two"), 3.0 - 0.5),  # not a number
    ("0", F.format("5"), 3.0 - 1.0),  # gold 0: no ratio
    ("72", "no tags, just 72", 4 * -0.5 + 0.0),  # every tag missing, no answer tag
    ("72", "<reasoning>r</reasoning> 72", 2 * 0.5 + 2 * -0.5),  # answer tags missing
    ("72", "text before " + F.format("72"), 4 * 0.5 + 3.0),  # not the exact shape: partial format
    ("72", "<reasoning>r</reasoning><answer>1</answer><answer>72</answer>", 2 * 0.5 + 2 * -0.5 + 3.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", F.format("72"), 6.0),
]


@pytest.mark.parametrize("gold,completion,expected", MATH_VERIFY_CASES)
def test_math_verify_table(gold, completion, expected):
    assert math_verify(["p"], [completion], answer=[gold]) == [expected]


@pytest.mark.parametrize("gold,completion,expected", GSM8K_CASES)
def test_gsm8k_table(gold, completion, expected):
    assert gsm8k(["p"], [completion], answer=[gold]) == [pytest.approx(expected)]


def test_gsm8k_custom_tokens_and_knobs():
    text = "<think>because</think><SOLUTION>12</SOLUTION>"
    kwargs = dict(
        reasoning_start_token="<think>",
        reasoning_end_token="</think>",
        solution_start_token="<SOLUTION>",
        solution_end_token="</SOLUTION>",
    )
    assert gsm8k(["p"], [text], answer=["12"], **kwargs) == [6.0]
    assert gsm8k(["p"], [text], answer=["12"], reward_exact_answer=10.0, reward_exact_format_match=1.0, **kwargs) == [
        11.0
    ]
    assert gsm8k(["p"], [text], answer=["12"]) == [4 * -0.5]  # default tags are absent


def test_math_verify_tags_are_configurable():
    assert math_verify(
        ["p"], ["<SOLUTION>1/2</SOLUTION> 7"], answer=["0.5"], solution_start="<SOLUTION>", solution_end="</SOLUTION>"
    ) == [1.0]
    assert math_verify(["p"], ["<SOLUTION>1/2</SOLUTION> 7"], answer=["0.5"]) == [0.0]  # last number: 7
    assert math_verify(["p"], ["\\boxed{4}"], answer=["4"], correct_reward=2.0) == [2.0]


def test_shaping_rewards_against_numpy():
    ids = [[1] * n for n in (0, 10, 95, 100, 101, 130)]
    lengths = np.array([len(x) for x in ids], float)
    comps = ["x"] * len(ids)
    # DAPO: 0 up to L_max - L_cache, linear to -1 at L_max, -1 beyond.
    l_max, cache = 100, 20
    expected = np.where(
        lengths <= l_max - cache, 0.0, np.where(lengths <= l_max, (l_max - cache - lengths) / cache, -1.0)
    )
    np.testing.assert_allclose(
        overlong(comps, comps, max_length=l_max, buffer=cache, completion_ids=ids), expected, atol=1e-12
    )
    np.testing.assert_allclose(
        length_penalty(comps, comps, max_length=100, coef=0.2, completion_ids=ids),
        -0.2 * np.minimum(lengths, 100) / 100,
        atol=1e-12,
    )
    with pytest.raises(ValueError, match="completion_ids"):
        overlong(comps, comps, max_length=10, buffer=2)
    pattern = r"<reasoning>.+</reasoning>\s*<answer>.+</answer>"
    assert format_reward(
        ["p"] * 3,
        [
            "<reasoning>a\nb</reasoning> <answer>1</answer>",
            "<answer>1</answer>",
            "pre <reasoning>a</reasoning><answer>1</answer>",
        ],
        pattern=pattern,
    ) == [1.0, 0.0, 0.0]
    assert format_reward(
        ["p"], ["pre <reasoning>a</reasoning><answer>1</answer>"], pattern=pattern, full_match=False
    ) == [1.0]


def test_reasoning_gym_reward_uses_the_task_checker():
    from core.sources import reasoning_gym_records
    from rewards.rgym import reasoning_gym

    rows = reasoning_gym_records("basic_arithmetic", 4, seed=3)
    answers, metadata = [r["answer"] for r in rows], [r["metadata"] for r in rows]
    right = [f"<answer>{a}</answer>" for a in answers]
    assert reasoning_gym(["p"] * 4, right, answers, metadata) == [1.0] * 4
    assert reasoning_gym(["p"] * 4, [f"work...\nAnswer: {a}" for a in answers], answers, metadata) == [1.0] * 4
    wrong = [f"\\boxed{{{int(a) + 1}}}" for a in answers]
    assert reasoning_gym(["p"] * 4, wrong, answers, metadata) == [0.0] * 4


# ---------------------------------------------------------------- runner


def _runner(*fns, timeout=10.0, procs=2, failure=None):
    cfg = RewardConfig(
        functions=list(fns), math_verify_timeout=timeout, math_verify_num_procs=procs, failure_reward=failure
    )
    return RewardRunner(cfg)


def test_weighted_sum_order_and_metrics():
    comps = [f"<answer>{i}</answer>" + "x" * i for i in range(7)]
    answers = [str(i if i % 2 else i + 1) for i in range(7)]
    with _runner(
        {"fn": "math_verify", "weight": 2.0},
        {"fn": f"{PLUGINS}:char_count", "weight": 0.5},
        {"fn": f"{PLUGINS}:uses_answer", "weight": -1.0, "kwargs": {"bonus": 0.25}},
        procs=3,
    ) as runner:
        batch = runner.score(["p"] * 7, comps, {"answer": answers})
    correct = np.array([float(i % 2 == 1) for i in range(7)])
    chars = np.array([len(c) for c in comps], float)
    uses = np.array([float(c == a) + 0.25 for c, a in zip(comps, answers)])
    np.testing.assert_allclose(batch.values["math_verify"], correct)
    np.testing.assert_allclose(batch.values["char_count"], chars)
    np.testing.assert_allclose(batch.total, 2.0 * correct + 0.5 * chars - uses, rtol=1e-6)
    m = batch.metrics()
    assert m["reward/mean"] == pytest.approx(float(batch.total.mean()))
    assert m["reward/char_count/mean"] == pytest.approx(chars.mean())
    assert m["reward/math_verify/failure_rate"] == 0.0 and not batch.errors


@pytest.mark.parametrize(
    "plugin,trigger,message",
    [
        ("raises_on_trigger", "raise", "RuntimeError: plugin exploded"),
        ("hangs_on_trigger", "hang", "timed out after 2 s"),
        ("aborts_on_trigger", "abort", "worker died"),
        ("wrong_length_on_trigger", "long", "returned 5 values for 4 completions"),
        ("nan_on_trigger", "nan", "item 1: nan is not a finite number"),
        ("words_on_trigger", "word", "item 1: 'high' is not a finite number"),
    ],
)
def test_misbehaving_plugin_fails_its_items_and_the_pool_recovers(plugin, trigger, message):
    """Failed items are marked (NaN: no score stands in for a failure), the others score, the pool recovers."""
    with _runner(
        {"fn": f"{PLUGINS}:char_count"}, {"fn": f"{PLUGINS}:{plugin}", "weight": 1.0}, timeout=2.0, procs=2
    ) as runner:
        # 8 completions, 2 workers: items 0-3 and 4-7; the trigger sits in item 5 (shard item 1).
        comps = [f"c{i}" + (f" {trigger}" if i == 5 else "") for i in range(8)]
        start = time.monotonic()
        batch = runner.score(["p"] * 8, comps)
        assert time.monotonic() - start < 2.0 + 5.0
        np.testing.assert_allclose(batch.values["char_count"], [len(c) for c in comps])  # order preserved
        bad = batch.failed[plugin]
        shard_level = plugin not in ("nan_on_trigger", "words_on_trigger")
        expected_bad = [4, 5, 6, 7] if shard_level else [5]
        assert np.flatnonzero(bad).tolist() == expected_bad
        assert np.isnan(batch.values[plugin][bad]).all() and np.isnan(batch.total[bad]).all()
        np.testing.assert_array_equal(batch.failed_any, bad)
        np.testing.assert_allclose(batch.values[plugin][~bad], 1.0)
        m = batch.metrics()
        assert m[f"reward/{plugin}/failure_rate"] == m["reward/failure_rate"] == len(expected_bad) / 8
        good = [len(c) + 1.0 for i, c in enumerate(comps) if i not in expected_bad]
        assert m["reward/mean"] == pytest.approx(np.mean(good))  # over the scored items only
        assert message in batch.errors[plugin][0]
        # The pool recovered: the next (benign) batch scores normally.
        again = runner.score(["p"] * 8, [f"ok{i}" for i in range(8)])
        assert not again.failed[plugin].any() and not again.errors
        np.testing.assert_allclose(again.values[plugin], 1.0)


def test_failure_reward_is_an_explicit_opt_in():
    with _runner({"fn": f"{PLUGINS}:raises_on_trigger", "weight": 2.0}, timeout=2.0, procs=1, failure=-3.0) as runner:
        batch = runner.score(["p"] * 3, ["a", "raise", "b"])
    assert batch.failed["raises_on_trigger"].all()  # one worker: the whole batch was its shard
    np.testing.assert_allclose(batch.values["raises_on_trigger"], -3.0)
    np.testing.assert_allclose(batch.total, -6.0)


def test_a_crashed_shard_drops_every_group_it_touches():
    """9 completions in groups of 3, two workers (items 0-4 and 5-8): a worker that dies on item 5 fails items
    5-8, which straddle groups 1 and 2; both groups are dropped from the loss, group 0 trains."""
    from posttrain.advantages import group_advantages

    with _runner({"fn": f"{PLUGINS}:aborts_on_trigger"}, timeout=5.0, procs=2) as runner:
        comps = [f"c{i}" + (" abort" if i == 5 else "") for i in range(9)]
        batch = runner.score(["p"] * 9, comps)
    assert np.flatnonzero(batch.failed_any).tolist() == [5, 6, 7, 8]
    rewards = batch.total.copy()
    rewards[:3] = [0.0, 1.0, 0.0]  # give group 0 some variance (the plugin scores 1.0 everywhere)
    adv = group_advantages(rewards, 3)
    assert adv.failed_groups == 2
    assert adv.trainable.tolist() == [True] * 3 + [False] * 6 and not adv.values[3:].any()
    assert adv.keep[:3].all() and adv.values[:3].any()


def _adversarial() -> list[str]:
    hazards = [
        "9^{9^{9^{9}}}",
        "9**9**9**9",
        "10^{10^{10}}",
        "e^{e^{e^{e}}}",
        "\\frac{1}{0}",
        "0/0",
        "1/0",
        "9" * 1_000_000,
        "x" * 1_000_000,
        "{" * 10_000,
        "(" * 5_000 + ")" * 5_000,
        "\\boxed{" * 5_000,
        "\\sqrt{" * 2_000 + "2" + "}" * 2_000,
        "1000000!",
        "\\infty",
        "\\sqrt{-1}",
        "NaN",
        "答案是 ７２ 😀 \u202e\u0000",
        "\\int_0^1 x\\,dx",
        "\\sum_{n=1}^{\\infty} \\frac{1}{n}",
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        "<answer>" * 10_000,
        "</answer>" * 10_000,
        "1" + "0" * 5_000,
        "\\boxed{" + "1+" * 20_000 + "1}",
    ]
    wrappers = ["{}", "\\boxed{{{}}}", "<answer>{}</answer>", "<reasoning>r</reasoning><answer>{}</answer>"]
    return [w.replace("{}", h) if w != "\\boxed{{{}}}" else "\\boxed{" + h + "}" for h in hazards for w in wrappers]


def test_adversarial_completions_are_bounded():
    comps = _adversarial()
    assert len(comps) == 100
    timeout = 20.0
    with _runner({"fn": "math_verify"}, {"fn": "gsm8k"}, timeout=timeout, procs=2) as runner:
        start = time.monotonic()
        batch = runner.score(["p"] * 100, comps, {"answer": ["72"] * 100})
        elapsed = time.monotonic() - start
    assert elapsed < 2 * timeout + 5.0, elapsed
    assert np.isfinite(batch.total).all()
    assert not batch.failed["gsm8k"].any() and not batch.failed["math_verify"].any(), batch.errors
    assert batch.values["math_verify"].sum() == 0.0  # nothing here equals 72


# ---------------------------------------------------------------- registry


def test_builtins_resolve_and_unknown_names_list_them():
    for name in BUILTINS:
        assert callable(resolve(name))
    with pytest.raises(UnknownReward, match="did you mean 'math_verify'.*Built-ins: math_verify, gsm8k"):
        resolve("math_verfy")
    with pytest.raises(UnknownReward, match="has no attribute 'nope'"):
        resolve(f"{PLUGINS}:nope")
    with pytest.raises(UnknownReward, match="not a function"):
        resolve(f"{PLUGINS}:not_a_function")
    with pytest.raises(UnknownReward, match="does not exist"):
        resolve("no/such/file.py:f")
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\.fn.*Built-ins: math_verify"):
        load_config(overrides=["reward.functions=[{fn: mathverify}]"], schema=PostTrainConfig)


def test_file_and_entry_point_plugins(tmp_path, monkeypatch):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def brevity(prompts, completions, **_):\n    return [-float(len(c)) for c in completions]\n")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency foo')\n")
    with pytest.raises(UnknownReward, match="loading .*broken.py failed: ImportError: missing dependency foo"):
        resolve(f"{broken}:f")

    dist = tmp_path / "site" / "temper_test_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: temper-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[temper.rewards]\nchars = {PLUGINS}:char_count\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert canonical("chars") == f"{PLUGINS}:char_count"

    monkeypatch.chdir(tmp_path)  # file plugins are relative to the working directory
    cfg = load_config(
        overrides=["reward.functions=[{fn: 'my_reward.py:brevity'}, {fn: chars, weight: 2}]"], schema=PostTrainConfig
    ).reward
    with RewardRunner(cfg) as runner:
        batch = runner.score(["p", "p"], ["ab", "abcd"])
    np.testing.assert_allclose(batch.total, [-2 + 4, -4 + 8])
    assert list(batch.values) == ["brevity", "chars"]


def test_bad_columns_are_reported():
    with _runner({"fn": "math_verify"}, procs=1) as runner:
        with pytest.raises(ValueError, match="reward column 'answer' has 1 values for 2 completions"):
            runner.score(["p", "p"], ["a", "b"], {"answer": ["1"]})
        batch = runner.score(["p", "p"], ["a", "b"])  # missing column: the function raises, items fail
        assert batch.failed["math_verify"].all()
        assert "answer" in batch.errors["math_verify"][0]


def test_reasoning_gym_rows_carry_json_metadata():
    from core.sources import reasoning_gym_records

    row = reasoning_gym_records("basic_arithmetic", 1, seed=0)[0]
    assert json.loads(row["metadata"])["source_dataset"] == "basic_arithmetic"


def test_power_towers_are_not_evaluated():
    # Without the guard each of these spends math-verify's whole comparison timeout.
    start = time.monotonic()
    assert (
        math_verify(
            ["p"] * 3,
            ["9**9**9**9", "\\boxed{9**9**9}", "<answer>2^2^2^2^2</answer>"],
            answer=["72"] * 3,
            timeout_seconds=2,
        )
        == [0.0] * 3
    )
    assert time.monotonic() - start < 1.5
