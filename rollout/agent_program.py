"""Agent programs written against an OpenAI client, run in the reward worker pool (`rl.agent.program`), and agents run
as commands (`rl.agent.command`, `CommandRunner`).

    async def run(row: dict, client: openai.AsyncOpenAI) -> float | dict | None:
        reply = await client.chat.completions.create(model="temper", messages=[...], tools=[...])
        ...
        return 1.0            # the episode's reward; a dict of named rewards; None: the run's reward functions decide

A program is a plugin, named as reward functions are (`package.module:function`, `path/to/file.py:function`, an
entry point of `temper.agents`): a coroutine function of the row and a client whose base URL is the episode's own
on the run's endpoint (`rollout.endpoint`). Its calls are what the method trains on; what it returns is the
episode's reward. `ProgramRunner` runs a shard of a step's episodes in one worker, concurrently (an agent mostly
waits for the model), each under its own timeout; the pool's deadline bounds the whole shard (an agent that blocks
the worker's event loop is killed with its worker). An episode whose program raises, times out or returns
something else fails, with the reason; one that timed out, or whose calls failed on the endpoint's side (it could
not be reached, or answered 5xx: an engine failed), is marked with that cause for another attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from rewards.registry import resolve


def check_program(spec: str) -> None:
    """Refuse, at start, a program that does not import or is not `async def run(row, client)`."""
    fn = resolve(spec, "agent")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{spec} is not a coroutine function (async def run(row, client))")
    try:
        inspect.signature(fn).bind({}, None)
    except TypeError as err:
        raise ValueError(f"{spec} cannot be called as run(row, client): {err}") from None


def episode_value(out: Any) -> tuple[float | dict[str, float] | None, str | None]:
    """A program's return value as the episode's reward (None: the reward functions'), or why it is not one."""
    if out is None:
        return None, None
    if isinstance(out, bool) or not isinstance(out, (int, float, dict)):
        return None, f"the program returned {type(out).__name__}, not a number, a dict of numbers or None"
    items = out.items() if isinstance(out, dict) else [("", out)]
    for name, value in items:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, f"the program returned {value!r}{f' for {name!r}' if name else ''}, not a finite number"
    return (float(out) if not isinstance(out, dict) else {str(k): float(v) for k, v in out.items()}), None


def lost(err: BaseException) -> bool:
    """Whether a program's exception came from outside the model and the program: the endpoint could not be reached
    or failed serving the call (an engine that raised or restarted), as opposed to a refusal (4xx) or the agent's
    own bug. Such an episode is worth another attempt (`rl.agent.retries`)."""
    import openai

    if isinstance(err, openai.APIConnectionError):  # includes APITimeoutError
        return True
    return isinstance(err, openai.APIStatusError) and err.status_code >= 500


class SharedHTTP(httpx.AsyncClient):
    """A shard's connection pool for its episodes' clients: a program that closes its client (`async with client:`)
    does not close the pool under the other episodes' clients; the runner closes it (`close_shared`)."""

    async def aclose(self) -> None:
        pass

    async def close_shared(self) -> None:
        await super().aclose()


# An episode's outcome: its value (None: the reward functions'), why it failed (None: it did not), and, when the
# failure came from outside the model, its cause (retried): "timeout", "engine" (the endpoint unreachable or 5xx).
Outcome = tuple[Any, str | None, str | None]


class ProgramRunner:
    """What a worker of the pool builds once per program (`rewards.pool.Call`)."""

    def __init__(self, program: str, timeout_s: float):
        self.program: Any = resolve(program, "agent")
        self.timeout_s = timeout_s

    def run(self, rows: Sequence[dict], urls: Sequence[str]) -> list[Outcome]:
        """Each episode's `Outcome`, in order."""
        return asyncio.run(self._all(rows, urls))

    async def _all(self, rows: Sequence[dict], urls: Sequence[str]) -> list[Outcome]:
        # One HTTP connection pool for the shard's clients: an `openai` client builds its own otherwise, ~20 ms of
        # CPU each (an SSL context), which for a step's episodes was most of what the endpoint path cost.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        http = SharedHTTP(limits=limits, timeout=self.timeout_s)
        try:
            return list(await asyncio.gather(*(self._one(r, u, http) for r, u in zip(rows, urls, strict=True))))
        finally:
            await http.close_shared()

    async def _one(self, row: dict, url: str, http: Any) -> Outcome:
        import openai

        # No retries: a call the endpoint refuses is the program's error, and a retried call would sample again.
        # Not closed here: closing it would close the shard's shared connection pool.
        client = openai.AsyncOpenAI(
            base_url=url, api_key="temper", max_retries=0, timeout=self.timeout_s, http_client=http
        )
        try:
            out = await asyncio.wait_for(self.program(dict(row), client), self.timeout_s)
        except TimeoutError:
            return None, f"the program did not finish in {self.timeout_s:g} s", "timeout"
        except Exception as err:
            return None, f"the program raised {type(err).__name__}: {err}", "engine" if lost(err) else None
        value, why = episode_value(out)
        return (value, None, None) if why is None else (None, why, None)


def command_argv(command: str) -> list[str]:
    """A command's argv (split as a shell would, never run by one); refused, at start, when its program is not
    found."""
    argv = shlex.split(command)
    if not argv:
        raise ValueError("the command is empty")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"{argv[0]!r} is not an executable on PATH or a path to one")
    return argv


class CommandRunner:
    """Agents run as commands (`rl.agent.command`), one process per episode, concurrently, in its own process group:
    the row as JSON on stdin; `OPENAI_BASE_URL` (the episode's base URL: the `openai` clients read it),
    `OPENAI_API_KEY` and `TEMPER_EPISODE_URL` set; its reward the last line it prints, as JSON (a number, an object
    of numbers, or null: the reward functions'). A non-zero exit fails the episode with the end of its stderr; one
    past `timeout_s` is killed with its group (a failure outside the model, retried). The command itself is killed
    when the worker that started it dies (a worker killed at its deadline, a run killed); processes it started
    itself go with it on a timeout (its group), but outlive a dead worker unless it ends them."""

    def __init__(self, command: str, timeout_s: float):
        self.argv, self.timeout_s = command_argv(command), timeout_s

    def run(self, rows: Sequence[dict], urls: Sequence[str]) -> list[Outcome]:
        return asyncio.run(self._all(rows, urls))

    async def _all(self, rows: Sequence[dict], urls: Sequence[str]) -> list[Outcome]:
        return list(await asyncio.gather(*(self._one(r, u) for r, u in zip(rows, urls, strict=True))))

    async def _one(self, row: dict, url: str) -> Outcome:
        env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": "temper", "TEMPER_EPISODE_URL": url}
        pipe = asyncio.subprocess.PIPE
        # Through a small launcher (no code runs between fork and exec here, where other threads may hold locks):
        # it asks for SIGKILL when this worker dies, then execs the command, in a process group of its own.
        argv = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *self.argv]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=pipe, stdout=pipe, stderr=pipe, env=env, start_new_session=True
            )
        except (OSError, subprocess.SubprocessError) as failure:  # the command's failure, not retried
            return None, f"the command could not start: {type(failure).__name__}: {failure}", None
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(row).encode()), self.timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)  # the command and whatever it started
            await proc.wait()
            return None, f"the command did not finish in {self.timeout_s:g} s", "timeout"
        finally:
            _kill_group(proc.pid)  # what it left running in its group
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-500:]
            return None, f"the command exited with status {proc.returncode}: {tail}", None
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None, "the command printed nothing (its last line is the reward: a number, an object or null)", None
        try:
            value = json.loads(lines[-1])
        except ValueError:
            return None, f"the command's last line is not JSON: {lines[-1][:200]!r}", None
        value, why = episode_value(value)
        return (value, None, None) if why is None else (None, why.replace("the program", "the command"), None)


# Runs in the command's process before the command: SIGKILL when the worker that started it dies (PR_SET_PDEATHSIG;
# kept across exec), and out at once if it already has; then the command itself (execvp; a missing one exits 127).
_LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as err:
    sys.exit(f"the command could not start: {err}")
"""


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
