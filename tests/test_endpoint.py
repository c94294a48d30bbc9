"""The OpenAI-compatible endpoint (`rollout.endpoint`), driven by the real `openai` client over HTTP, in front of the
JAX sampler's slots (a real sampler, float32): tool calls in OpenAI's format from vLLM's Hermes parser, the
trajectory an agent's calls leave (token in / token out), several episodes at once with a fork, the trainer's
log-probs of every recorded token equal to the sampler's, and what the endpoint refuses."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.calculator import calculator
from rollout.tools import tool_schema
from tests.test_agent_run import assert_completions_carry_the_samplers_log_probs, calling_agent, stopping_model

TOOLS = [tool_schema(calculator)]


def _endpoint(tok, path, max_model_len=2048, slots=4, reasoning=None):
    from core.chat_template import turn_stop_ids
    from core.hf.directory import load_hf
    from rollout.endpoint import Endpoint
    from rollout.jax_engine import SlotTurns
    from rollout.jax_sampler import JaxSampler
    from rollout.sampler import SamplingParams
    from rollout.tool_parsing import ToolParsers

    sampler = JaxSampler(load_hf(path)[0], tok.name_or_path, max_model_len=max_model_len, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5, stop_token_ids=turn_stop_ids(tok))
    turns = SlotTurns(sampler, slots=slots)
    endpoint = Endpoint(turns, tok, ToolParsers("hermes", tok), params, max_model_len, reasoning=reasoning)
    endpoint.start()
    return endpoint


def test_an_agent_calling_tools_through_the_openai_client_leaves_its_trajectory(tmp_path):
    """A scripted model (Qwen2.5's template, Hermes calls) calls the calculator every turn; the agent, written
    against `openai.AsyncOpenAI`, runs each call itself and sends the result back, three calls: each reply is an
    OpenAI tool call with the sampler's log-probs; the episode's one trajectory is the rendering of the whole
    conversation, the model's tokens sampled, the tool results context."""
    import openai

    from core.chat import chat_prompt_ids

    tok, path, (start, body, end) = calling_agent(tmp_path)
    endpoint = _endpoint(tok, path)

    returned: list[float] = []

    async def agent(url: str) -> list[dict]:
        client = openai.AsyncOpenAI(base_url=url, api_key="temper")
        messages: list[dict] = [{"role": "user", "content": "What is 12 + 30?"}]
        for _ in range(3):
            reply = await client.chat.completions.create(model="temper", messages=messages, tools=TOOLS, logprobs=True)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.logprobs.content) == 4
            returned.extend(t.logprob for t in choice.logprobs.content)
            (called,) = choice.message.tool_calls
            arguments = json.loads(called.function.arguments)
            messages.append(choice.message.model_dump(exclude_none=True))
            result = calculator(**arguments)
            messages.append({"role": "tool", "tool_call_id": called.id, "content": str(result)})
        models = await client.models.list()
        assert [m.id for m in models.data] == ["temper"]
        return messages

    try:
        url = endpoint.open("ep-0")
        messages = asyncio.run(agent(url))
        (trajectory,) = [s.completion() for s in endpoint.finish("ep-0")]
        with pytest.raises(openai.NotFoundError, match="no episode 'ep-0' is open"):
            openai.OpenAI(base_url=url, api_key="x").chat.completions.create(model="temper", messages=messages[:1])
    finally:
        endpoint.close()
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["42"] * 3
    sampled = [t for t, own in zip(trajectory.token_ids, trajectory.sampled, strict=True) if own]
    assert sampled == [start, body, end, tok.eos_token_id] * 3
    # token in / out: the recorded trajectory, up to the last turn, is the template's rendering of the conversation
    last_turn = len(trajectory.token_ids) - 4
    assert trajectory.prompt_ids + trajectory.token_ids[:last_turn] == chat_prompt_ids(tok, messages[:-2], TOOLS)
    assert [lp for lp, own in zip(trajectory.logprobs, trajectory.sampled, strict=True) if own] == returned


def test_episodes_at_once_with_a_fork_train_on_the_samplers_own_log_probs(tmp_path_factory, tmp_path):
    """Four episodes at once through the endpoint, each three calls (the model's reply, then a user turn), the
    second call asking for two choices (the episode forks: one segment continues, the other branches at the same
    point); every recorded trajectory's sampled tokens carry, in the trainer's batch, the trainer's log-prob equal
    to the sampler's (float32), and the log-probs the client got are those recorded."""
    import openai

    from tests.test_chat import make_tokenizer

    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    path = stopping_model(tmp_path / "model", tok, "qwen2")
    endpoint = _endpoint(tok, path, max_model_len=512)
    returned: dict[str, list[float]] = {}

    async def agent(url: str, question: str) -> None:
        client = openai.AsyncOpenAI(base_url=url, api_key="temper")
        messages: list[dict] = [{"role": "user", "content": question}]
        for k in range(3):
            reply = await client.chat.completions.create(
                model="temper", messages=messages, n=2 if k == 1 else 1, logprobs=True, temperature=0.7
            )
            for choice in reply.choices:
                returned.setdefault(url, []).extend(t.logprob for t in choice.logprobs.content)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]

    async def all_at_once(urls):
        await asyncio.gather(*(agent(u, q) for u, q in zip(urls, ["What is 2 + 3?", "Add 10 and 7.", "Hi.", "Count."])))

    try:
        urls = [endpoint.open(f"ep-{i}") for i in range(4)]
        asyncio.run(all_at_once(urls))
        trajectories = {u: [s.completion() for s in endpoint.finish(f"ep-{i}")] for i, u in enumerate(urls)}
    finally:
        endpoint.close()
    assert endpoint.overridden == 12  # every call asked for temperature 0.7; the run's 1.0 applied
    completions = [c for segs in trajectories.values() for c in segs]
    assert all(len(segs) == 2 for segs in trajectories.values())  # the main line and the fork at call 2
    assert all(sum(not s for s in c.sampled) > 0 for c in completions)  # the user turns are context
    for url, (main, fork) in trajectories.items():
        # the fork shares the main line's tokens up to its branch point (call 1's turn and the user turn after it)
        shared = next(i for i, (a, b) in enumerate(zip(main.token_ids, fork.token_ids)) if a != b)
        assert sum(fork.sampled[:shared]) > 0 and main.token_ids[:shared] == fork.token_ids[:shared]
        recorded = [lp for c in (main, fork) for lp, own in zip(c.logprobs, c.sampled, strict=True) if own]
        once = recorded[: len(recorded) - sum(fork.sampled[:shared])]  # without the fork's copy of the shared turn
        assert len(once) == len(returned[url]) and sorted(set(recorded)) == pytest.approx(sorted(set(returned[url])))
    assert_completions_carry_the_samplers_log_probs(completions, path, 1e-4)


def test_a_reasoning_parser_returns_the_think_block_apart_and_the_episode_keeps_it(tmp_path):
    """`rl.agent.reasoning_parser=qwen3` (vLLM's parser): a scripted model on Qwen3's template thinks, closes the think
    block, then calls the calculator; the reply's `reasoning` (and `reasoning_content`) is the think block, its tool
    call is read from the content, and its content holds no think tag. The agent sends the reply back as the client
    got it (its reasoning included, then, the second time, without it) with the tool's result: every call continues
    the same segment, whose sampled tokens are every token the model wrote, think blocks included (token in / token
    out). A reply that never closes its think block is all reasoning (vLLM's `qwen3` parser); a client's
    `chat_template_kwargs` is refused."""
    import openai

    from core.chat import chat_prompt_ids
    from rollout.reasoning import ReasoningSplitter
    from tests.chat_families import FAMILIES, chat_tokenizer
    from tests.test_agent_run import CALL, scripted_model

    spec = {**FAMILIES["qwen3"], "added": [*FAMILIES["qwen3"]["added"], "<tool_call>", "</tool_call>", CALL]}
    tok = chat_tokenizer(tmp_path / "tokenizer", "qwen3", spec=spec)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>", CALL, "</tool_call>")}
    header = chat_prompt_ids(tok, [{"role": "user", "content": "What is 12 + 30?"}])[-1]
    thought = tok.encode("Sum")[0]
    chain = [header, ids["<think>"], thought, ids["</think>"], ids["<tool_call>"], ids[CALL], ids["</tool_call>"]]
    successors = dict(zip(chain, [*chain[1:], tok.eos_token_id], strict=True))
    path = scripted_model(tmp_path / "model", tok, "qwen2", successors)
    endpoint = _endpoint(tok, path, reasoning=ReasoningSplitter("qwen3", tok))

    async def agent(url: str) -> list:
        client = openai.AsyncOpenAI(base_url=url, api_key="temper")
        messages: list[dict] = [{"role": "user", "content": "What is 12 + 30?"}]
        replies = []
        for k in range(3):
            reply = await client.chat.completions.create(model="temper", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            replies.append(message)
            (called,) = message.tool_calls
            result = calculator(**json.loads(called.function.arguments))
            echoed = message.model_dump(exclude_none=True)
            if k == 1:  # an agent that keeps no reasoning in its history
                echoed = {key: v for key, v in echoed.items() if key not in ("reasoning", "reasoning_content")}
            messages += [echoed, {"role": "tool", "tool_call_id": called.id, "content": str(result)}]
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs is not supported"):
            await client.chat.completions.create(
                model="temper", messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
            )
        return replies

    try:
        replies = asyncio.run(agent(endpoint.open("ep")))
        segments = [s.completion() for s in endpoint.finish("ep")]
    finally:
        endpoint.close()
    for message in replies:
        extra = message.model_extra or {}
        assert extra["reasoning"] == extra["reasoning_content"] == tok.decode([thought]), extra
        assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
        assert message.tool_calls[0].function.name == "calculator"
    (segment,) = segments  # the replies sent back, with and without their reasoning, continued the segment
    sampled = [t for t, own in zip(segment.token_ids, segment.sampled, strict=True) if own]
    assert sampled == [*chain[1:], tok.eos_token_id] * 3
    assert ReasoningSplitter("qwen3", tok).split("It is 42.") == ("It is 42.", "")  # never closed: all reasoning


def test_what_the_endpoint_refuses(tmp_path_factory, tmp_path):
    import openai

    from tests.test_chat import make_tokenizer

    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    endpoint = _endpoint(tok, stopping_model(tmp_path / "model", tok, "qwen2"), max_model_len=64)
    try:
        client = openai.OpenAI(base_url=endpoint.open("ep"), api_key="temper")
        user = [{"role": "user", "content": "What is 2 + 3?"}]
        cases = [
            (dict(stream=True), "stream is not supported"),
            (dict(tool_choice="required", tools=TOOLS), "tool_choice='required' is not supported"),
            (dict(top_logprobs=2, logprobs=True), "top_logprobs is not supported"),
            (dict(messages=[{"role": "user", "content": "2 + 3 " * 40}]), "of the context's 64"),
        ]
        for kwargs, message in cases:
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(**{"model": "temper", "messages": user, **kwargs})
        with pytest.raises(openai.BadRequestError, match="the prompt is empty"):
            client.completions.create(model="temper", prompt="", max_tokens=4)
        raw = client.completions.create(model="temper", prompt="What is 2 + 3?", max_tokens=4, logprobs=1)
        assert raw.choices[0].text is not None and len(raw.choices[0].logprobs.token_logprobs) >= 1
        (segment,) = [s.completion() for s in endpoint.finish("ep")]
        assert segment.prompt_ids == tok.encode("What is 2 + 3?") and all(segment.sampled)
    finally:
        endpoint.close()


def test_the_pump_fails_the_turns_of_an_engine_that_raises_and_goes_on():
    """A stand-in `Turns` (a unit test of the pump's own logic): a turn whose engine raises fails with that error,
    the next one is served; a turn of an affinity whose last turn is back reuses its key."""
    from rollout.sampler import Completion, SamplingParams
    from rollout.turn_pump import TurnPump

    class Flaky:
        def __init__(self):
            self.waiting, self.keys = [], []

        def put(self, requests):
            self.waiting += requests
            self.keys += [r.key for r in requests]

        def take(self):
            r = self.waiting.pop(0)
            if r.token_ids == [0]:
                raise RuntimeError("engine died")
            return [(r.key, Completion(r.token_ids, [7], [-1.0], "stop", ""))]

    turns = Flaky()
    pump = TurnPump(turns)
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            pump.submit([0], SamplingParams(), affinity="a").result(10)
        assert pump.submit([1], SamplingParams(), affinity="b").result(10).token_ids == [7]
        assert pump.submit([2], SamplingParams(), affinity="b").result(10).token_ids == [7]
        assert pump.submit([4], SamplingParams(), affinity="a").result(10).token_ids == [7]
    finally:
        pump.close()
    assert turns.keys[1] == turns.keys[2]  # "b"'s second turn went where its first did
    assert turns.keys[3] not in turns.keys[:3]  # "a"'s failed turn may come back late: its key is not used again
    with pytest.raises(RuntimeError, match="closed"):
        pump.submit([3], SamplingParams())
