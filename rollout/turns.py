"""Where episodes' turns are sampled: each as its own request, as soon as its episode is ready, on engines that run
many at once (vLLM on Ray; the JAX sampler's slots, `rollout.jax_engine.SlotTurns`), or together, a batch a round
(any `generate` function: a sampler of your own, a scripted one in a test).

    turns = EngineTurns(group, push)                 # a SamplerGroup of RemoteVLLMSamplers
    turns = SlotTurns(jax_sampler, slots=32)         # continuous batching on the JAX sampler (rollout.jax_engine)
    turns = LockstepTurns(generate)                  # generate(prompts, params): any sampler's
    turns.put([TurnRequest(key, token_ids, params)]) # an episode's next turn
    done = turns.take()                              # [(key, Completion)]: at least one, once some finished

`rollout.episodes.run_episodes` drives either. With `EngineTurns` an episode waits for nobody: its turn goes to
the engine that served its earlier turns (so the engine's prefix cache holds its history), joins the requests that
engine is running, and comes back as soon as it stops, while the others go on decoding (the engine's continuous
batching). `rollout.jax_engine.SlotTurns` does the same on the JAX sampler, in fixed slots that keep each
episode's cache from one turn to the next. `LockstepTurns` samples every queued turn in one request per kind of
turn: each round waits for its longest turn.

A sampler that fails while it holds turns is replaced (or dropped with its node) as `SamplerGroup` does for a
batch, and the turns it held are sampled again by the sampler that takes over: a turn's tokens are appended to its
episode only once it comes back whole, so sampling it again changes nothing the episode holds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout.background import Cancelled
from rollout.group import SamplerFailed
from rollout.sampler import Completion, SamplingParams, sample_seed


@dataclass(frozen=True)
class TurnRequest:
    key: int  # the episode's (unique among the turns in flight)
    token_ids: list[int]  # the episode so far: its prompt and every turn
    params: SamplingParams  # n = 1; its max_tokens the episode's room, its seed the episode's and the turn's


@dataclass
class TurnProgress:
    """What an engine returns from `advance`: the turns that finished, and how many it still runs."""

    finished: list[tuple[int, Completion]]
    running: int


class Turns(Protocol):
    def put(self, requests: Sequence[TurnRequest]) -> None: ...

    def take(self) -> list[tuple[int, Completion]]:
        """Turns that finished: at least one while any was put and not yet taken."""
        ...


class LockstepTurns:
    """Every queued turn sampled at once by `generate`: one request per distinct (max_tokens, sampling) (a sampler
    refuses a prompt whose length plus max_tokens exceeds its model length, and episodes near their budget have
    less room), seeded from its members' seeds."""

    def __init__(self, generate: Callable[[list[list[int]], SamplingParams], list[Completion]]):
        self.generate = generate
        self.queue: list[TurnRequest] = []

    def put(self, requests: Sequence[TurnRequest]) -> None:
        self.queue.extend(requests)

    def take(self) -> list[tuple[int, Completion]]:
        queue, self.queue = self.queue, []
        kinds: dict[SamplingParams, list[TurnRequest]] = {}
        for r in queue:
            kinds.setdefault(dataclasses.replace(r.params, seed=None), []).append(r)
        out: list[tuple[int, Completion]] = []
        for kind, members in kinds.items():
            seeds = [r.params.seed for r in members]
            seed = None if None in seeds else sample_seed(*(s for s in seeds if s is not None))
            got = self.generate([r.token_ids for r in members], dataclasses.replace(kind, seed=seed))
            out.extend((r.key, c) for r, c in zip(members, got, strict=True))
        return out


class EngineTurns:
    """Each turn its own request on a vLLM engine, the engines kept busy: whenever an engine returns finished turns
    it is sent the turns queued for it since (or asked to go on with the ones it runs) before they are handed out,
    so it decodes while the environment answers. `slice_s`: the longest an engine decodes before it returns with
    nothing finished (so that turns queued meanwhile join the batch it runs)."""

    def __init__(
        self,
        group: Any,
        push: Callable[[Any], Any],
        slice_s: float = 0.05,
        wait: Callable | None = None,
        cancelled: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`wait(refs, timeout)`: the refs among `refs` that are ready, at least one unless `timeout` passed
        (default: `ray.wait`'s); `cancelled`: set when the run stops (`take` then raises `Cancelled`); `clock`:
        the time each call's deadline counts on."""
        self.group, self.push, self.slice_s = group, push, slice_s
        self.wait = wait or _ray_wait
        self.cancelled = cancelled
        self.clock = clock
        self.deadline: dict[Any, float] = {}  # object ref -> when its call counts as hung (the sampler's timeout)
        self.home: dict[int, Any] = {}  # episode key -> the sampler serving its turns
        self.queued: dict[int, list[TurnRequest]] = {}  # id(sampler) -> turns not yet sent to it
        self.held: dict[int, dict[int, TurnRequest]] = {}  # id(sampler) -> turns its engine runs
        self.calls: dict[Any, Any] = {}  # object ref -> the sampler of an `advance` call in flight (one a sampler)
        self.redone: set[int] = set()  # episodes whose turn a failed sampler held, until that turn comes back

    def put(self, requests: Sequence[TurnRequest]) -> None:
        for r in requests:
            sampler = self.home.get(r.key)
            if sampler is None or sampler not in self.group.samplers:  # new, or its sampler was replaced
                sampler = min(self.group.samplers, key=self._load)
                self.home[r.key] = sampler
            self.queued.setdefault(id(sampler), []).append(r)

    def _load(self, sampler: Any) -> int:
        return len(self.queued.get(id(sampler), ())) + len(self.held.get(id(sampler), ()))

    def take(self) -> list[tuple[int, Completion]]:
        out: list[tuple[int, Completion]] = []
        while not out:
            if self.cancelled is not None and self.cancelled.is_set():
                raise Cancelled("the run is stopping: the episodes in flight are dropped")
            for sampler in list(self.group.samplers):
                self._send(sampler)
            if not self.calls:
                return out  # nothing was put
            # Each call has its own deadline: an engine that hangs is found while the others go on answering. A call
            # whose answer is back is never late, however long the driver was away (an environment step, an engine
            # restart).
            now = self.clock()
            late = [ref for ref in self.calls if self.deadline[ref] <= now and not self.wait([ref], 0.0)]
            if late:
                from ray.exceptions import GetTimeoutError

                sampler = self.calls[late[0]]
                self._fail(sampler, GetTimeoutError(f"no turn came back in {sampler.timeout_s:.0f} s"))
                continue
            ready = self.wait(list(self.calls), max(0.0, min(self.deadline[ref] for ref in self.calls) - now))
            for ref in ready:
                sampler = self.calls.pop(ref)
                del self.deadline[ref]
                try:
                    progress: TurnProgress = sampler.result(ref)
                except Exception as err:
                    self._fail(sampler, err)
                    continue
                held = self.held.get(id(sampler), {})
                for key, completion in progress.finished:
                    held.pop(key)
                    self.redone.discard(key)
                    out.append((key, completion))
                self._send(sampler)  # at once: it decodes while these turns are handed out
        return out

    def _send(self, sampler: Any) -> None:
        """An `advance` call to `sampler` when it has none in flight and has turns to take or to run."""
        if any(s is sampler for s in self.calls.values()):
            return
        new = self.queued.pop(id(sampler), [])
        held = self.held.setdefault(id(sampler), {})
        if not new and not held:
            return
        held.update((r.key, r) for r in new)
        ref = sampler.submit_turns(new, self.slice_s)
        self.calls[ref] = sampler
        self.deadline[ref] = self.clock() + sampler.timeout_s

    def _fail(self, failed: Any, err: Exception) -> None:
        """`failed`'s turns (queued or running) to the sampler that takes over from it."""
        for ref in [r for r, s in self.calls.items() if s is failed]:
            del self.calls[ref], self.deadline[ref]
        lost = list(self.held.pop(id(failed), {}).values()) + self.queued.pop(id(failed), [])
        again = sorted(r.key for r in lost if r.key in self.redone)
        if again:  # as a batch is redone once (`SamplerGroup`): an engine that fails on every turn stops the run
            raise SamplerFailed(
                f"a sampler failed again on the turns it took over from a failed one (episodes {again[:5]}; "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); stopping. Run the same "
                "command again to resume from the last checkpoint."
            ) from err
        successor = self.group.take_over(failed, err, self.push)
        self.redone.update(r.key for r in lost)
        self.group.redone_prompts += len(lost)
        for r in lost:
            self.home[r.key] = successor
        self.queued.setdefault(id(successor), []).extend(lost)


def _ray_wait(refs: list, timeout: float) -> list:
    import ray

    return ray.wait(refs, num_returns=1, timeout=timeout)[0]


def turn_seed(seed: int | None, key: int, turn: int) -> int | None:
    """An episode's turn's seed: its own stream, whatever else was sampled beside it."""
    return None if seed is None else sample_seed(seed, key, turn)
