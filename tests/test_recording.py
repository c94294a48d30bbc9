"""The endpoint's recorder (`rollout.recording`): the calls of an OpenAI-style agent become token trajectories, token
in / token out, on the chat templates the families ship; a call that rewrites the history starts a segment; two
calls from one point fork it."""

from __future__ import annotations

import json

import pytest

from core.chat import chat_prompt_ids
from core.chat_template import render_template
from rollout.calculator import calculator
from rollout.recording import Recorder, canonical
from rollout.sampler import Completion
from rollout.tool_parsing import ParsedTurn, ToolParsers
from rollout.tools import tool_schema
from tests.chat_families import FAMILIES, chat_tokenizer
from tests.test_chat import A1, A2, Q1, Q2, R1, R2, SYSTEM, TOOL, make_tokenizer

TOOLS = [tool_schema(calculator)]
CALL = {"name": "calculator", "arguments": {"expression": "12 * 7"}}


def model_turn(tok, messages, reply, tools) -> list[int]:
    """The tokens a model consistent with the template samples for `reply` after `messages`: the text the template
    writes for it after the generation prompt, through the token that ends the turn, tokenized on its own (a
    scripted model; the sampler's tokens reach the recorder as token ids, never as text)."""
    prompt = render_template(tok, messages, True, tools)
    whole = render_template(tok, [*messages, reply], False, tools)
    assert whole.startswith(prompt)
    turn = whole[len(prompt) :]
    end = min(turn.index(t) + len(t) for t in (tok.eos_token, "<|im_end|>", "<|eot_id|>") if t in turn)
    return tok.encode(turn[:end], add_special_tokens=False)


def family_tokenizer(tmp_path_factory, family: str):
    """The family's offline tokenizer with the tool-call markers Qwen's tokenizers carry as added tokens (a call's
    `<tool_call>` is one token there, as in the shipped tokenizer, not merged with the newline before it)."""
    if not family.startswith("qwen"):
        return make_tokenizer(tmp_path_factory, family)
    spec = {**FAMILIES[family], "added": [*FAMILIES[family].get("added", []), "<tool_call>", "</tool_call>"]}
    corpus = [SYSTEM, Q1, Q2, A1, A2, R1, R2, TOOL, "system user assistant model tool"] * 10
    return chat_tokenizer(tmp_path_factory.mktemp(family), family, None, corpus, spec)


def sample(recorder, parsers, messages, reply, tools=TOOLS):
    """One call: its prompt, the scripted model's tokens for `reply`, recorded; (the message the client gets, the
    call's prompt)."""
    call = recorder.prompt(messages, tools)
    ids = model_turn(recorder.tokenizer, messages, reply, tools)
    out = Completion(call.token_ids, ids, [-0.5] * len(ids), "stop", "")
    text = recorder.tokenizer.decode(ids[:-1], skip_special_tokens=False)
    return recorder.record(call, out, parsers.for_tools(tools).parse(text)), call.token_ids


THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1"])
def test_a_three_call_episode_is_the_templates_rendering_of_the_whole_conversation(tmp_path_factory, family):
    """Three calls, as an agent makes them with an OpenAI client (a tool call, its result, another call, its
    result, an answer; each call sends the whole conversation, the replies as the client got them): one segment
    whose tokens before each turn are the template's rendering of that call's messages, the model's tokens
    marked sampled with their log-probs, the template's not."""
    tok = family_tokenizer(tmp_path_factory, family)
    parsers, recorder = ToolParsers("hermes" if family.startswith("qwen") else "llama3_json", tok), Recorder(tok)
    calling = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]}
    answer = {"role": "assistant", "content": "It is 85."}
    messages = [{"role": "user", "content": "What is 12 * 7 + 1?"}]
    prompts, sampled = [], []
    for k, reply in enumerate([calling, calling, answer]):
        got, prompt = sample(recorder, parsers, messages, reply)
        prompts.append(prompt)
        sampled.append(model_turn(tok, messages, reply, TOOLS))
        rendered = chat_prompt_ids(tok, messages, TOOLS)
        if family == "qwen3" and k > 0:
            # Qwen3's template drops the think block of earlier replies; the trajectory keeps the tokens sampled:
            # the rendering with those blocks back in place, not the rendering itself
            assert prompt != rendered
            assert tok.decode(prompt) == tok.decode(rendered).replace(
                "<|im_start|>assistant\n<tool_call>", THINK + "<tool_call>"
            )
        else:
            assert prompt == rendered  # token in = the template's rendering of the whole conversation
        if reply is calling:
            assert got["tool_calls"][0]["function"]["name"] == "calculator"
            # the text outside the call: none, or Qwen3's (empty) think block (no reasoning parser splits it off)
            assert got["content"] == ("<think>\n\n</think>\n\n" if family == "qwen3" else None)
            assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == CALL["arguments"]
            messages += [got, {"role": "tool", "tool_call_id": got["tool_calls"][0]["id"], "content": "84"}]
    think = "<think>\n\n</think>\n\n" if family == "qwen3" else ""
    assert got == {"role": "assistant", "content": think + "It is 85."}
    (segment,) = recorder.segments
    (completion,) = recorder.completions()
    assert segment.turns == 3 and completion.finish_reason == "stop" and completion.text == think + "It is 85."
    assert completion.prompt_ids + completion.token_ids == prompts[-1] + sampled[-1]
    model = [t for t, s in zip(completion.token_ids, completion.sampled) if s]
    assert model == [t for turn in sampled for t in turn]  # the model's tokens, exactly as sampled
    assert all((lp == -0.5) == s for lp, s in zip(completion.logprobs, completion.sampled))
    assert not all(completion.sampled)  # the tool results are context


def test_a_call_that_rewrites_the_history_starts_a_segment_and_two_calls_from_one_point_fork(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    parsers, recorder = ToolParsers("hermes", tok), Recorder(tok)
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    first, _ = sample(recorder, parsers, user, {"role": "assistant", "content": "5"})
    go_on = [*user, first, {"role": "user", "content": "Sure?"}]
    sample(recorder, parsers, go_on, {"role": "assistant", "content": "Yes."})
    assert len(recorder.segments) == 1 and recorder.segments[0].turns == 2
    # the client's own copy of the reply (another field order, content parts, a null tool_calls) still extends it
    echoed = {"tool_calls": None, "content": [{"type": "text", "text": "5"}], "role": "assistant"}
    assert canonical(echoed) == canonical(first)
    # a summarised history: a new segment from the template's rendering
    summary = [{"role": "user", "content": "You said 5 for 2 + 3. Sure?"}]
    sample(recorder, parsers, summary, {"role": "assistant", "content": "Yes."})
    # a reply the agent edited before sending it back: not what was sampled, so not an extension
    edited = [*user, {"role": "assistant", "content": "five"}, {"role": "user", "content": "Sure?"}]
    sample(recorder, parsers, edited, {"role": "assistant", "content": "Yes."})
    # a branch from the first reply, which the first segment went on past: a fork sharing its tokens up to there
    branch = [*user, first, {"role": "user", "content": "And 2 + 4?"}]
    sample(recorder, parsers, branch, {"role": "assistant", "content": "6"})
    assert [s.turns for s in recorder.segments] == [2, 1, 1, 2]
    fork, base = recorder.segments[3], recorder.segments[0]
    shared = len(chat_prompt_ids(tok, user)) + len(model_turn(tok, user, first, TOOLS))
    assert fork.ids[:shared] == base.ids[:shared] and fork.ids[shared:] != base.ids[shared:]
    assert fork.ids == chat_prompt_ids(tok, branch, TOOLS) + model_turn(
        tok, branch, {"role": "assistant", "content": "6"}, TOOLS
    )


def test_a_turn_cut_at_its_limit_cannot_be_extended(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    recorder, parsers = Recorder(tok), ToolParsers("hermes", tok)
    user = [{"role": "user", "content": "Count to three."}]
    call = recorder.prompt(user, TOOLS)
    cut = tok.encode(" one two", add_special_tokens=False)
    reply = recorder.record(
        call,
        Completion(call.token_ids, cut, [-1.0] * len(cut), "length", ""),
        parsers.for_tools(TOOLS).parse(" one two"),
    )
    assert recorder.completions()[0].finish_reason == "length"
    call = recorder.prompt([*user, reply, {"role": "user", "content": "Go on."}], TOOLS)
    assert call.base is None  # no stop token to continue after: a new segment
    with pytest.raises(ValueError, match="at least one message"):
        recorder.prompt([], TOOLS)


def test_raw_completions_continue_their_tokens_and_a_finished_recording_takes_nothing(tmp_path_factory):
    """`/completions` calls: a prompt that starts with a raw segment's tokens continues it (what follows is
    context), even though a raw turn has no stop token; once the episode is finished, a late reply is refused and
    the segments handed out do not change."""
    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    recorder, none = Recorder(tok), ParsedTurn("", "")
    first = recorder.prompt_tokens([5, 6, 7])
    recorder.record(first, Completion([5, 6, 7], [8, 9], [-1.0, -1.0], "length", ""), none, ended=False)
    second = recorder.prompt_tokens([5, 6, 7, 8, 9, 10])
    assert second.base == 0 and second.context == [10]
    recorder.record(second, Completion(second.token_ids, [11], [-2.0], "length", ""), none, ended=False)
    (segment,) = recorder.segments
    assert segment.token_ids == [8, 9, 10, 11] and segment.sampled == [True, True, False, True]
    handed = recorder.close()
    late = recorder.prompt_tokens([5, 6, 7, 8, 9, 10, 11, 12])
    with pytest.raises(RuntimeError, match="recording is closed"):
        recorder.record(late, Completion(late.token_ids, [13], [-1.0], "length", ""), none, ended=False)
    assert handed[0].token_ids == [8, 9, 10, 11] and handed[0] is not segment
