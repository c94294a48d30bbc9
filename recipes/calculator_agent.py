"""The tools demo's calculator agent, written against the `openai` client as an agent written elsewhere would be
(`rl.agent.program: recipes.calculator_agent:run`; `make demo-agent`).

It talks to the model only through the client: each call sends the whole conversation with the calculator's schema;
each tool call in the reply is run here and its result sent back as a `tool` message; a reply without a call is the
answer, which the run's reward functions score (it returns None). The run records what each call sampled and trains
on it, token in / token out (docs/agents.md). The tool and its schema are the ones the built-in `tools` environment
runs (the demo's fine-tuning traces were rendered with them), so the two paths give the model the same tokens.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.calculator import calculator
from rollout.tools import tool_schema

MAX_CALLS = 3  # the model's turns, as the tools demo's rl.agent.max_turns
TOOLS = [tool_schema(calculator)]


async def run(row: dict, client: Any) -> None:
    import openai

    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_CALLS):
        try:
            reply = await client.chat.completions.create(model="temper", messages=messages, tools=TOOLS)
        except openai.BadRequestError as err:
            if "tokens of the context" not in str(err):
                raise  # a refusal other than "no room left" is a bug to see
            return None  # no room left for another turn: the episode ends where it is (the tools demo truncates)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason != "tool_calls":
            return None  # the answer
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as err:  # the model's mistake: it reads the error, as the built-in tools answer it
                result = f"error: {type(err).__name__}: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return None
