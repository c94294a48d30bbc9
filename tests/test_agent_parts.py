"""Multi-turn rollouts, part by part: tools and their schemas, vLLM's tool parsers, the worker pool's calls, the
environment runner's checks, the tokens a template appends after a turn, episodes' limits and the batch's mask."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest

from core.chat import chat_prompt_ids, continuation_ids
from core.chat_template import ChatTemplateError
from rewards.pool import WorkerPool
from rollout.calculator import calculator
from rollout.environment import EnvironmentRunner
from rollout.episodes import EpisodeLimits, run_episodes
from rollout.sampler import Completion, SamplingParams
from rollout.tool_parsing import ToolCallParser, ToolParsers
from rollout.tools import ToolCall, call_tool, check_arguments, tool_schema
from rollout.turns import LockstepTurns
from tests.test_chat import make_tokenizer

# ---------------------------------------------------------------------------------------------------- tools


def power(base: int, exponent: int = 2, note: str = "") -> int:
    """Raise a number to a power.

    Args:
        base: The number.
        exponent: The power.
        note: Ignored.
    """
    return base**exponent


def test_a_tools_schema_is_transformers_own_and_calls_are_checked_against_it():
    schema = tool_schema(power)
    from transformers.utils import get_json_schema

    assert schema == get_json_schema(power) and schema["function"]["parameters"]["required"] == ["base"]
    assert check_arguments(schema, '{"base": 3}') == {"base": 3}
    bad = {
        '{"exponent": 2}': "missing required argument",
        '{"base": 3, "root": 2}': "unknown argument.*root",
        '{"base": "3"}': "'base' must be integer",
        '{"base": true}': "'base' must be integer",
        '{"base": 3.5}': "'base' must be integer",
        "[3]": "must be a JSON object",
        '{"base": 3': "not valid JSON",
    }
    for arguments, message in bad.items():
        with pytest.raises(ValueError, match=message):
            check_arguments(schema, arguments)


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def odd() -> object:
    """Return something that is not JSON."""
    return object()


def test_every_failure_of_a_call_is_a_reply_the_model_reads():
    cases = [
        (None, ToolCall("nope", "{}"), "unknown_tool", "no tool named 'nope'"),
        (power, ToolCall("power", '{"base": "x"}'), "bad_arguments", "bad call to power"),
        (power, ToolCall("power", '{"base": 10, "exponent": 100000000}'), None, None),
        (slow, ToolCall("slow", '{"seconds": 5}'), "timeout", "did not finish within 0.2 s"),
        (odd, ToolCall("odd", "{}"), "bad_result", "not text or JSON"),
        (calculator, ToolCall("calculator", '{"expression": "__import__(\\"os\\")"}'), "raised", "unsupported"),
    ]
    for fn, call, error, message in cases[:2] + cases[3:]:
        reply = call_tool(fn, None if fn is None else tool_schema(fn), call, timeout_s=0.2)
        assert reply.error == error and message in reply.content, (call, reply)
    t0 = time.monotonic()
    reply = call_tool(slow, tool_schema(slow), ToolCall("slow", '{"seconds": 5}'), timeout_s=0.2)
    assert reply.error == "timeout" and time.monotonic() - t0 < 2
    assert call_tool(power, tool_schema(power), ToolCall("power", '{"base": 3}')).content == "9"


def test_the_calculator_computes_and_refuses_what_is_not_arithmetic():
    assert calculator("(12 + 7) * 3") == "57" and calculator("7 / 2") == "3.5" and calculator("2 ** 10") == "1024"
    for expression in ("os.system('x')", "[1] * 9", "2 ** 99999", "a + 1"):
        with pytest.raises(ValueError):
            calculator(expression)


# ---------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("family,parser", [("qwen2_5", "hermes"), ("llama3_1", "llama3_json")])
def test_vllms_parsers_read_calls_and_a_malformed_call_is_named(tmp_path_factory, family, parser):
    tok = make_tokenizer(tmp_path_factory, family)
    tools = [tool_schema(calculator)]
    p = ToolCallParser(parser, tok, tools)
    args = {"expression": "2 + 2"}
    if parser == "hermes":
        good = (
            'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
        )
        broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + </tool_call>'
    else:
        good = '{"name": "calculator", "parameters": ' + json.dumps(args) + "}"
        broken = '<|python_tag|>{"name": "calculator", "parameters": {"expression"'
    turn = p.parse(good)
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [("calculator", args)], turn
    assert turn.malformed is None
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    p._log.addHandler(handler)
    try:
        bad = p.parse(broken)
        # The parser's own traceback for it is not logged (the turn is answered and counted instead), and its
        # logger is left as it was: what it logs outside a turn's parsing still shows.
        assert not logged and not p._log.filters
        p._log.error("outside a parse")
        assert [r.getMessage() for r in logged] == ["outside a parse"]
    finally:
        p._log.removeHandler(handler)
    assert bad.tool_calls == [] and bad.malformed is not None and "could not be read" in bad.malformed, bad
    plain = p.parse("The answer is 4.")
    assert plain.tool_calls == [] and plain.malformed is None and plain.content == "The answer is 4."


def test_an_unknown_parser_is_refused_with_the_list(tmp_path_factory):
    with pytest.raises(ValueError, match="unknown tool parser 'hermez'.*hermes"):
        ToolCallParser("hermez", make_tokenizer(tmp_path_factory, "qwen2_5"))


# ------------------------------------------------------------------------------------------- token in / out


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1"])
def test_the_tokens_after_a_turn_are_what_the_template_writes_there(tmp_path_factory, family):
    """A trajectory extended by `continuation_ids` (prompt, the turn's own tokens, the template's tokens for the
    tool reply) equals the template's rendering of the whole conversation where the template does not rewrite
    the history (Qwen2.5, Llama 3.1); on Qwen3, which rewrites the last turn's think block, the appended tokens
    are the rendering's tokens after the turn's end, and the history stays as sampled."""
    tok = make_tokenizer(tmp_path_factory, family)
    tools = [tool_schema(calculator)]
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = {"role": "tool", "name": "calculator", "content": "5"}
    prompt = chat_prompt_ids(tok, user, tools)
    eos = tok.eos_token
    turn = [*tok.encode("2 + 3 = 5.", add_special_tokens=False), tok.convert_tokens_to_ids(eos)]
    more = continuation_ids(tok, [reply], eos, tools)
    whole = chat_prompt_ids(tok, [*user, {"role": "assistant", "content": "2 + 3 = 5."}, reply], tools)
    text = tok.decode(more, skip_special_tokens=False)
    assert ("5" in text and eos not in text.split("5")[0]) or family == "qwen3", text
    if family == "qwen3":
        assert whole[-len(more) :] == more  # the same tail: what follows the turn's end
    else:
        assert prompt + turn + more == whole
    assert (
        tok.decode(more, skip_special_tokens=False)
        .rstrip()
        .endswith(
            {"qwen2_5": "<|im_start|>assistant", "qwen3": "<|im_start|>assistant", "llama3_1": "<|end_header_id|>"}[
                family
            ]
        )
    )


@pytest.mark.parametrize("family", ["gptoss", "glm4moe", "qwen2_5", "llama3_1"])
def test_a_calling_turn_ends_where_the_template_ends_it_and_the_result_follows_it(tmp_path_factory, family):
    """A turn that calls a tool, sampled up to the first of the template's turn ends (`turn_stop_ids`: gpt-oss's
    `<|call|>`, GLM's `<|observation|>`, ChatML's `<|im_end|>`, Llama's `<|eot_id|>`), then extended by
    `continuation_ids` with the call's name: exactly the template's rendering of the call and its result. gpt-oss
    names the function in the result's header: without the call, its template refuses the result."""
    from core.chat_template import turn_stop_ids

    tok = make_tokenizer(tmp_path_factory, family)
    tools = [tool_schema(calculator)]
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    reply = {"role": "tool", "name": "calculator", "content": "5"}
    prompt = chat_prompt_ids(tok, user, tools)
    whole = chat_prompt_ids(tok, [*user, {"role": "assistant", "content": "", "tool_calls": [call]}, reply], tools)
    assert whole[: len(prompt)] == prompt
    stops = set(turn_stop_ids(tok))
    end = next(k for k in range(len(prompt), len(whole)) if whole[k] in stops)  # where sampling stops
    turn = whole[len(prompt) : end + 1]
    stop = tok.convert_ids_to_tokens(whole[end])
    assert (
        "calculator" in tok.decode(turn)
        and stop
        == {"gptoss": "<|call|>", "glm4moe": "<|observation|>", "qwen2_5": "<|im_end|>", "llama3_1": "<|eot_id|>"}[
            family
        ]
    )
    assert prompt + turn + continuation_ids(tok, [reply], stop, tools, ["calculator"]) == whole
    if family == "gptoss":
        with pytest.raises(ChatTemplateError, match="no previous assistant message with a tool call"):
            continuation_ids(tok, [reply], stop, tools)
        # A final reply stops on `<|return|>`, which the template writes as `<|end|>` in the history: the sampled
        # token stays, and the user's next turn follows as the template writes it after `<|end|>`
        question = {"role": "user", "content": "And 3 + 4?"}
        more = continuation_ids(tok, [question], "<|return|>", tools)
        history = chat_prompt_ids(tok, [*user, {"role": "assistant", "content": "5"}, question], tools)
        assert history[-len(more) :] == more and tok.decode(more).startswith("<|start|>user"), tok.decode(more)


def test_a_template_that_does_not_close_a_turn_on_the_stop_token_is_refused(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    with pytest.raises(ChatTemplateError, match="does not close an assistant turn with '<\\|eot_id\\|>'"):
        continuation_ids(tok, [{"role": "tool", "content": "5"}], "<|eot_id|>")
    # A base model's EOS is a stop token, but the template never writes it after a turn: nothing continues after it
    from tests.chat_families import FAMILIES, chat_tokenizer

    spec = {**FAMILIES["qwen2_5"], "eos": "<|endoftext|>"}
    base = chat_tokenizer(tmp_path_factory.mktemp("base_eos"), "qwen2_5", spec=spec)
    with pytest.raises(ChatTemplateError, match="does not close an assistant turn with '<\\|endoftext\\|>'"):
        continuation_ids(base, [{"role": "tool", "content": "5"}], "<|endoftext|>", called=["calculator"])


class Scripted:
    """A stand-in sampler for the episode loop's bookkeeping (the real samplers run in tests/test_agent_run.py):
    each request's i-th prompt gets the next reply of its script, as token ids ending with the stop token."""

    def __init__(self, tok, replies: list[str], max_model_len: int = 10**6):
        self.tok, self.replies, self.requests, self.max_model_len = tok, replies, [], max_model_len

    def __call__(self, prompts, params):
        self.requests.append((prompts, params))
        out = []
        for p in prompts:  # as the real samplers refuse it
            assert len(p) + params.max_tokens <= self.max_model_len, (len(p), params.max_tokens)
            text = self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]
            ids = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
            cut = ids[: params.max_tokens]
            out.append(Completion(list(p), cut, [-0.5] * len(cut), "stop" if len(cut) == len(ids) else "length", text))
        return out


def test_an_episode_holds_the_prompt_the_models_tokens_and_the_tools_replies_and_honours_its_limits(
    tmp_path_factory,
):
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    pool = WorkerPool(1)
    try:
        # A roomy limit: the pool's fresh worker imports the environment first, which took over 10 s on a loaded CI
        # machine (the suite's workers run at nice 19); limits are tested with hanging environments above.
        env = EnvironmentRunner("tools", {"tools": ["calculator"]}, pool, timeout_s=120.0)
        call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
        wrong = '<tool_call>\n{"name": "abacus", "arguments": {}}\n</tool_call>'
        sampler = Scripted(tok, [call, wrong, "It is 84."])
        params = SamplingParams(n=1, temperature=1.0, max_tokens=200, seed=3)
        rows = [{"prompt": "What is 12 * 7?"}]
        [episode] = run_episodes(
            LockstepTurns(sampler), env, tok, rows, EpisodeLimits(4, 200, 3000), params, ToolParsers("hermes", tok)
        )
        assert episode.finish == "done" and episode.turns == 3, episode
        assert episode.tool_calls == 2 and episode.tool_errors == 1 and episode.final_text == "It is 84."
        c = episode.completion()
        model = [t for t, s in zip(c.token_ids, c.sampled) if s]
        env_text = tok.decode([t for t, s in zip(c.token_ids, c.sampled) if not s], skip_special_tokens=False)
        assert tok.decode(model, skip_special_tokens=False) == f"{call}<|im_end|>{wrong}<|im_end|>It is 84.<|im_end|>"
        assert "84" in env_text and "no tool named 'abacus'" in env_text and "<tool_response>" in env_text
        assert c.logprobs[: len(model)].count(-0.5) >= 1 and sum(c.sampled) == len(model)
        # Each turn continued from the whole trajectory so far (token in), and no two turns shared a seed.
        prompts = [r[0][0] for r in sampler.requests]
        assert prompts[1][: len(prompts[0])] == prompts[0] and prompts[2][: len(prompts[1])] == prompts[1]
        assert len({r[1].seed for r in sampler.requests}) == 3
        # Out of turns: never answered, handled as truncated; out of tokens likewise.
        [short] = run_episodes(
            LockstepTurns(Scripted(tok, [call])),
            env,
            tok,
            rows,
            EpisodeLimits(2, 200, 3000),
            params,
            ToolParsers("hermes", tok),
        )
        assert short.finish == "turns" and short.completion().finish_reason == "length"
        # Near the budget a turn gets less room: a row with a longer prompt has less, and gets its own request
        # (a sampler refuses prompt + max_tokens beyond the model length), cut where its room ends.
        room = len(episode.prompt_ids) + 30
        long_row = {"prompt": "What is 12 * 7? " + "Think hard. " * 2}
        scripted = Scripted(tok, [call], max_model_len=room)
        cut, cut_long = run_episodes(
            LockstepTurns(scripted),
            env,
            tok,
            [*rows, long_row],
            EpisodeLimits(4, 200, room),
            params,
            ToolParsers("hermes", tok),
        )
        assert cut.finish == cut_long.finish == "length" and cut.length == cut_long.length == room, (cut, cut_long)
        assert len(scripted.requests) == 2 and len({r[1].max_tokens for r in scripted.requests}) == 2
        assert len({r[1].seed for r in scripted.requests}) == 2
        # A prompt that does not fit never starts: failed, named, holding no token (no trainer row could hold it)
        limits = EpisodeLimits(4, 200, len(episode.prompt_ids))
        (too_long,) = run_episodes(
            LockstepTurns(scripted), env, tok, [long_row], limits, params, ToolParsers("hermes", tok)
        )
        assert too_long.finish == "failed" and "the prompt takes" in too_long.error and too_long.prompt_ids == []
    finally:
        pool.close()


def test_the_trainers_batch_trains_on_the_models_tokens_only():
    from posttrain.onpolicy.rl_batch import build_rl_batch

    sampled = [True, True, False, False, False, True, True]
    c = Completion([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [-1.0] * 7, "stop", "", sampled=sampled)
    plain = Completion([1, 2, 3], [4, 5, 6], [-1.0] * 3, "stop", "")
    batch = build_rl_batch([c, plain], np.array([1.0, -1.0]), np.ones(2, bool), row_len=16, max_tokens=8)
    want = np.array([*sampled, False], np.float32)
    np.testing.assert_array_equal(batch.packed.target_mask[0], want)
    np.testing.assert_array_equal(batch.loss_mask[0], want)
    np.testing.assert_array_equal(batch.kl_mask[0], want)
    np.testing.assert_array_equal(batch.loss_mask[1], [1, 1, 1, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="6 sampled flags for its 7 tokens"):
        bad = Completion([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], None, "stop", "", sampled=sampled[:-1])
        build_rl_batch([bad, plain], np.zeros(2), np.ones(2, bool), row_len=16, max_tokens=8)


def test_online_dpo_pairs_of_trajectories_train_on_the_models_tokens_only():
    """Online DPO over whole trajectories: the chosen and rejected episodes keep every token in the rows (the
    environment's as context), and only the model's are targets of the sequences' log-prob sums."""
    from posttrain.dpo.online import best_worst_pairs
    from posttrain.dpo.pairs import build_pair_batch

    a = Completion([1, 2, 3], [4, 5, 6, 7, 8], [-1.0] * 5, "stop", "", sampled=[True, True, False, False, True])
    b = Completion([1, 2, 3], [9, 10, 11], [-1.0] * 3, "stop", "", sampled=[True, False, True])
    pairs, _ = best_worst_pairs([b, a], np.array([0.0, 1.0]), 2)
    assert pairs[0].chosen == (4, 5, 6, 7, 8) and pairs[0].rejected_trained == (True, False, True)
    packed = build_pair_batch(pairs, slots=1, row_len=32).packed
    mask = np.asarray(packed.target_mask)
    np.testing.assert_array_equal(mask[0, :5], [1, 1, 0, 0, 1])
    np.testing.assert_array_equal(mask[1, :3], [1, 0, 1])
    assert mask[0, 5:].sum() == 0 and mask[1, 3:].sum() == 0
    np.testing.assert_array_equal(np.asarray(packed.target_ids)[0, :5], [4, 5, 6, 7, 8])
    assert {4, 5, 6, 7, 8, 9, 10, 11} <= set(np.asarray(packed.tokens).ravel().tolist())
    plain = build_pair_batch([pairs[0].__class__(0, (1, 2, 3), (4, 5), (9,))], slots=1, row_len=32).packed
    np.testing.assert_array_equal(np.asarray(plain.target_mask)[:, :2], [[1, 1], [1, 0]])  # single-turn: all


def test_an_episode_whose_environment_failed_is_started_again_and_counted(tmp_path_factory, tmp_path):
    """A reset that fails, or a step that hangs (a lost environment server), is the environment's failure, not the
    model's: that episode starts again from its row and ends done, its attempts' causes kept. A step that raises on
    what the model wrote is not retried. Without retries, the failures stand."""
    from posttrain.onpolicy.agent import episode_metrics

    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    rows = [{"prompt": p, "flaky": f} for p, f in (("A.", "reset"), ("B.", "hang"), ("C.", "raise"), ("D.", ""))]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=50, seed=3)
    pool = WorkerPool(2)
    try:
        for retries, attempt in ((1, "again"), (0, "once")):
            (tmp_path / attempt).mkdir()
            env = EnvironmentRunner(
                "tests.reward_plugins:FlakyEnvironment", {"dir": str(tmp_path / attempt)}, pool, timeout_s=3.0
            )
            sampler = Scripted(tok, ["Done."])
            episodes = run_episodes(
                LockstepTurns(sampler), env, tok, rows, EpisodeLimits(2, 50, 3000), params, ToolParsers("hermes", tok),
                retries=retries,
            )  # fmt: skip
            if retries:
                assert [e.finish for e in episodes] == ["done", "done", "failed", "done"], episodes
                assert [e.retried for e in episodes] == [["reset"], ["step"], [], []]
                assert "cannot read" in episodes[2].error  # the model's turn: not retried
                m = episode_metrics(episodes)
                assert m["agent/retries/reset"] == m["agent/retries/step"] == 1 / 4
                assert sum(len(r[0]) for r in sampler.requests) == 5  # B's first attempt's turn, then its second
            else:
                assert [e.finish for e in episodes] == ["failed", "failed", "failed", "done"]
                assert "went away" in episodes[0].error and "timed out" in episodes[1].error
    finally:
        pool.close()
