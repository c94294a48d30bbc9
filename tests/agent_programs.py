"""Agent programs for the tests, written against the `openai` client as an agent written elsewhere would be."""

from __future__ import annotations

import asyncio


async def chatter(row, client):
    """Three calls (the question, then "Go on." twice, each time the whole conversation with the replies as the
    client got them); the reward: the last reply's length modulo 5, which differs between a row's episodes."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="temper", messages=messages, max_tokens=32)
        message = reply.choices[0].message
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    return float(len(message.content or "") % 5)


async def raises(row, client):
    await client.chat.completions.create(model="temper", messages=[{"role": "user", "content": row["prompt"]}])
    raise RuntimeError("the agent's own bug")


async def hangs(row, client):
    await asyncio.sleep(3600)


async def says_yes(row, client):
    return "yes"


async def never_calls(row, client):
    return 1.0


async def summarises(row, client):
    """Two calls, the second extending the first, then a third from a summary of them (the history rewritten): two
    segments, the last reply in the second; the reward: the last reply's length modulo 5."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="temper", messages=messages, max_tokens=32)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    summary = [{"role": "user", "content": f"{row['prompt']} (You have answered twice.) Go on."}]
    reply = await client.chat.completions.create(model="temper", messages=summary, max_tokens=32)
    return float(len(reply.choices[0].message.content or "") % 5)


async def rewrites(row, client):
    """Two calls whose second does not extend the first (a summary of the history): two segments."""
    await client.chat.completions.create(model="temper", messages=[{"role": "user", "content": row["prompt"]}])
    summary = [{"role": "user", "content": "Earlier you answered. " + row["prompt"]}]
    await client.chat.completions.create(model="temper", messages=summary)
    return 1.0


async def returns_to_first(row, client):
    """A call, a call from a rewritten history (a second segment), then a call continuing the first conversation: the
    episode's last reply is in the first segment."""
    first = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="temper", messages=first, max_tokens=32)
    summary = [{"role": "user", "content": "Earlier you answered. " + row["prompt"]}]
    await client.chat.completions.create(model="temper", messages=summary, max_tokens=32)
    again = [*first, reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model="temper", messages=again, max_tokens=32)
    return 1.0


def not_async(row, client):
    return 1.0


async def hangs_once(row, client):
    """The first episode to start on a row's marker hangs (an agent stuck on something outside the model); every
    other one, a retry included, makes one call and returns 1."""
    import os

    try:
        os.close(os.open(row["marker"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        await client.chat.completions.create(model="temper", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0
    await asyncio.sleep(3600)
