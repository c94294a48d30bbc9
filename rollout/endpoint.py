"""An OpenAI-compatible server in front of a run's samplers that records what an agent's calls sampled, token in /
token out.

    endpoint = Endpoint(turns, tokenizer, ToolParsers("hermes", tokenizer), params, max_model_len=1024)
    endpoint.start()
    url = endpoint.open("episode-0")        # http://127.0.0.1:PORT/episodes/episode-0/v1: the agent's base URL
    client = AsyncOpenAI(base_url=url, api_key="temper")
    ...                                     # the agent calls client.chat.completions.create(...) as often as it likes
    segments = endpoint.finish("episode-0")        # what the calls sampled: [s.completion() for s in segments]
    endpoint.close()

Routes (each under `/episodes/{episode}/v1`, one base URL per episode, as the interception servers of verifiers
and NeMo-Gym do; `/v1/models` also at the root):

- `POST .../chat/completions`: `messages`, `tools`, `tool_choice` (`auto` or `none`), `n`, `max_tokens` /
  `max_completion_tokens`, `stop`, `logprobs`, `seed`. The prompt is the recorder's (`rollout.recording`: the
  episode's recorded tokens plus the template's for the new messages, or a new segment); each choice is one turn
  on the run's samplers (`rollout.turn_pump`); its text is read by vLLM's tool parser for the family, and the
  reply carries OpenAI `tool_calls` (`finish_reason` `tool_calls`), the text outside them, and with `logprobs`
  the sampler's log-prob of every token; with a reasoning parser (`rollout.reasoning`) its reasoning in `reasoning`
  and the tool calls read from the content alone.
- `POST .../completions`: a `prompt` (text, or token ids) continued as is, recorded as a segment of its own (or
  continuing one whose tokens it starts with).
- `GET .../models`: the served model's name.

Sampling is the run's (`rollout.temperature`, `top_p`, `top_k`): the trainer scores the tokens at the run's
temperature, so a client's `temperature` or `top_p` is not applied; each call that asked for another is counted
(`overridden`). `max_tokens` is capped by the run's `rollout.max_tokens` and by the room left in
`rollout.max_model_len`. Refused with a 400 and OpenAI's error body: `stream`, `top_logprobs`, a `tool_choice`
that forces a call, `chat_template_kwargs` (e.g. `enable_thinking`: the template renders as it ships), a prompt with
no room left, messages the template cannot render. An episode that is not open is
a 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI reads the handlers' annotations from here
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from core.chat_template import ChatTemplateError
from rollout.reasoning import ReasoningSplitter
from rollout.recording import Recorder, Segment
from rollout.sampler import Completion, SamplingParams
from rollout.tool_parsing import ParsedTurn, ToolParsers
from rollout.turn_pump import TurnPump
from rollout.turns import Turns, turn_seed


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields a server may ignore (user, metadata)

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    seed: int | None = None
    stream: bool | None = None
    chat_template_kwargs: dict | None = None  # refused: the run renders with the template as it ships


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str | list[int]
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    seed: int | None = None
    stream: bool | None = None


class SamplerFailed(Exception):
    """A turn the sampler failed (its engine raised or restarted): a 500, and the episode's failure is not its own."""


class Refused(Exception):
    """A request the endpoint cannot serve: a 400 (or `status`) with OpenAI's error body."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Endpoint:
    """The server (module docstring): a FastAPI app on uvicorn in a thread of the run's process."""

    def __init__(
        self,
        turns: Turns,
        tokenizer: Any,
        parsers: ToolParsers,
        params: SamplingParams,
        max_model_len: int,
        model: str = "temper",
        host: str = "127.0.0.1",
        port: int = 0,
        reasoning: ReasoningSplitter | None = None,
    ):
        """`reasoning`: splits each reply's reasoning from its content (`rl.agent.reasoning_parser`)."""
        self.tokenizer, self.parsers, self.params, self.reasoning = tokenizer, parsers, params, reasoning
        self.max_model_len, self.model, self.host, self.port = max_model_len, model, host, port
        self.stop_ids = frozenset(params.stop_token_ids) | {tokenizer.eos_token_id}
        self.pump = TurnPump(turns)
        self.recorders: dict[str, Recorder] = {}
        self.calls: dict[str, int] = {}  # per episode: its calls so far (each turn's seed)
        self.seed_keys: dict[str, int] = {}  # per episode: its turns' seeds' key
        self.errors: dict[str, int] = {}  # per episode: its calls the endpoint failed on its side (5xx)
        self.overridden = 0  # calls whose temperature / top_p the run's replaced
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve on `host` (a free port by default); the server's root URL."""
        import uvicorn

        config = uvicorn.Config(self.app(), host=self.host, port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.root

    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open(self, episode: str, seed_key: int | None = None) -> str:
        """Start recording `episode`; its base URL (what `OPENAI_BASE_URL` is set to). `seed_key`: what its turns'
        seeds are drawn from with the run's seed (default: the id's CRC; a run passes the episode's index, so that
        its draws do not depend on the id, which is random)."""
        self.recorders[episode] = Recorder(self.tokenizer)
        self.calls[episode] = 0
        self.errors[episode] = 0
        self.seed_keys[episode] = zlib.crc32(episode.encode()) if seed_key is None else seed_key
        return f"{self.root}/episodes/{episode}/v1"

    def served_errors(self, episode: str) -> int:
        """The calls of `episode` the endpoint failed on its side (5xx: the sampler failed the turn)."""
        return self.errors.get(episode, 0)

    def finish(self, episode: str) -> list[Segment]:
        """Stop recording `episode`: its segments (`Segment.completion()`: a trajectory), in the order they started;
        later calls to its URL are 404s."""
        self.calls.pop(episode, None)
        self.seed_keys.pop(episode, None)
        self.errors.pop(episode, None)
        return self.recorders.pop(episode).close()

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(10.0)
        self.pump.close()

    # -------------------------------------------------------------------------------------------- the app

    def app(self):
        app = FastAPI(title="Temper endpoint")

        def error(err: Refused) -> JSONResponse:
            body = {"error": {"message": str(err), "type": "invalid_request_error", "code": err.status}}
            return JSONResponse(body, status_code=err.status)

        async def served(handler, episode: str, request: Request):
            try:
                return await handler(episode, await request.json())
            except Refused as err:
                return error(err)
            except (ValueError, ChatTemplateError) as err:  # a malformed body, messages the template cannot render
                return error(Refused(f"{type(err).__name__}: {err}"))
            except SamplerFailed as err:  # an engine that raised or restarted: ours, 5xx, counted for the episode
                if episode in self.errors:
                    self.errors[episode] += 1
                body = {"error": {"message": str(err), "type": "server_error", "code": 500}}
                return JSONResponse(body, status_code=500)

        @app.get("/v1/models")
        @app.get("/episodes/{episode}/v1/models")
        async def models(episode: str | None = None):
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "temper"}]}

        @app.post("/episodes/{episode}/v1/chat/completions")
        async def chat(episode: str, request: Request):
            return await served(self._chat, episode, request)

        @app.post("/episodes/{episode}/v1/completions")
        async def completions(episode: str, request: Request):
            return await served(self._completion, episode, request)

        return app

    def _recorder(self, episode: str) -> Recorder:
        if episode not in self.recorders:
            raise Refused(f"no episode {episode!r} is open on this endpoint", status=404)
        return self.recorders[episode]

    def _turn_params(self, episode: str, body: Any, prompt_len: int, max_tokens: int | None) -> list[SamplingParams]:
        """Each of the call's `n` choices' sampling: the run's, with the call's budget and stop strings, and a seed
        of its own."""
        if body.stream:
            raise Refused("stream is not supported: the endpoint answers whole turns")
        if body.n < 1:
            raise Refused(f"n must be >= 1, got {body.n}")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise Refused(f"the prompt takes {prompt_len} tokens of the context's {self.max_model_len}")
        seed = body.seed if body.seed is not None else self.params.seed
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        budget = max(1, min(max_tokens or self.params.max_tokens, self.params.max_tokens, room))
        turn = dataclasses.replace(self.params, n=1, max_tokens=budget, stop=stop, logprobs=True)
        key, call = self.seed_keys.get(episode, 0), self.calls.get(episode, 0)
        return [dataclasses.replace(turn, seed=turn_seed(seed, key, call * 1024 + k)) for k in range(body.n)]

    def _count_overrides(self, body: Any) -> None:
        asked = (body.temperature, self.params.temperature), (body.top_p, self.params.top_p)
        if any(want is not None and want != run for want, run in asked):
            self.overridden += 1

    async def _sample(self, ids: list[int], params: list[SamplingParams], affinity: Any) -> list[Completion]:
        futures = [self.pump.submit(ids, p, affinity=(affinity, k)) for k, p in enumerate(params)]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except Exception as err:
            raise SamplerFailed(f"the sampler failed the turn: {type(err).__name__}: {err}") from err

    async def _chat(self, episode: str, raw: dict) -> dict:
        recorder = self._recorder(episode)
        body = ChatRequest.model_validate(raw)
        if body.top_logprobs:
            raise Refused("top_logprobs is not supported: each token carries the sampler's own log-prob")
        if body.chat_template_kwargs:
            raise Refused("chat_template_kwargs is not supported: the run's template renders as it ships")
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        if choice not in ("auto", "none"):
            raise Refused(f"tool_choice={choice!r} is not supported: auto or none (the sampler cannot force a call)")
        call = recorder.prompt(body.messages, body.tools)
        limit = body.max_completion_tokens or body.max_tokens
        params = self._turn_params(episode, body, len(call.token_ids), limit)
        self._count_overrides(body)
        self.calls[episode] = self.calls.get(episode, 0) + 1
        outs = await self._sample(call.token_ids, params, (episode, call.base))
        tools = body.tools if choice == "auto" else None
        choices, used = [], 0
        for k, out in enumerate(outs):
            ids = list(out.token_ids)
            ended = bool(ids) and ids[-1] in self.stop_ids
            text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            reasoning, text = self.reasoning.split(text) if self.reasoning is not None else (None, text)
            parsed = self.parsers.for_tools(tools).parse(text) if tools else ParsedTurn(text, text)
            message = recorder.record(call, out, parsed, ended=ended)
            if reasoning is not None:  # vLLM's field, and the name older servers gave it
                message = {**message, "reasoning": reasoning, "reasoning_content": reasoning}
            finish = (
                "tool_calls" if message.get("tool_calls") else ("length" if out.finish_reason == "length" else "stop")
            )
            entry: dict[str, Any] = {"index": k, "message": message, "finish_reason": finish}
            if body.logprobs:
                entry["logprobs"] = {"content": self._token_logprobs(out)}
            choices.append(entry)
            used += len(ids)
        return self._response("chat.completion", choices, len(call.token_ids), used)

    async def _completion(self, episode: str, raw: dict) -> dict:
        recorder = self._recorder(episode)
        body = CompletionRequest.model_validate(raw)
        ids = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)
        if not ids:
            raise Refused("the prompt is empty")
        call = recorder.prompt_tokens(ids)
        params = self._turn_params(episode, body, len(ids), body.max_tokens)
        self._count_overrides(body)
        self.calls[episode] = self.calls.get(episode, 0) + 1
        outs = await self._sample(list(ids), params, (episode, call.base))
        choices, used = [], 0
        for k, out in enumerate(outs):
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            recorder.record(call, out, ParsedTurn(text, text), ended=False)
            entry: dict[str, Any] = {"index": k, "text": text, "finish_reason": out.finish_reason}
            if body.logprobs is not None:
                pieces = [self.tokenizer.decode([t]) for t in out.token_ids]
                entry["logprobs"] = {"tokens": pieces, "token_logprobs": list(out.logprobs or []), "top_logprobs": None}
            choices.append(entry)
            used += len(out.token_ids)
        return self._response("text_completion", choices, len(ids), used)

    def _token_logprobs(self, out: Completion) -> list[dict]:
        pieces = [self.tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids]
        logprobs = out.logprobs or [0.0] * len(out.token_ids)
        return [
            {"token": p, "logprob": float(lp), "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, logprobs, strict=True)
        ]

    def _response(self, kind: str, choices: Sequence[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "choices": list(choices),
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
