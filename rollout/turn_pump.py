"""Turns from many callers on one `rollout.turns.Turns`: what a server's request handlers need.

    pump = TurnPump(SlotTurns(jax_sampler, slots=8))     # or EngineTurns(group, push): vLLM on Ray
    future = pump.submit(token_ids, params, affinity="episode-3")   # from any thread
    completion = future.result()                          # or `await asyncio.wrap_future(future)`
    pump.close()

A `Turns` is driven by one loop (`put` a turn, `take` those that finished), as `rollout.episodes.run_episodes`
does. Here the callers are concurrent (an HTTP server's handlers), so one thread owns the `Turns`: it puts every
turn submitted since its last look, takes what finished and resolves those futures, and waits for new turns when
none is in flight. A turn joins the ones running when the pump next looks, which is when some turn in flight has
finished (`take` returns once one has): a new call waits for the first of the running ones, not for all of them.

`affinity` names where a turn's history was sampled before (an episode, a conversation): while no turn of it is in
flight, its turns reuse one key, which the engines use to send a turn to the engine (or JAX slot) that holds its
history's cache. A `Turns` that raises fails every turn in flight with that error; the pump goes on.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Future

from rollout.sampler import Completion, SamplingParams
from rollout.turns import TurnRequest, Turns


class TurnPump:
    def __init__(self, turns: Turns, name: str = "turn-pump"):
        self._turns = turns
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._keys = itertools.count()
        self._affine: dict[Hashable, int] = {}  # affinity -> its key
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, token_ids: Sequence[int], params: SamplingParams, affinity: Hashable = None) -> Future:
        """A turn continuing `token_ids` (n = 1), sampled as soon as the engine takes it: a Future of its
        `Completion`."""
        if self._closed:
            raise RuntimeError("the turn pump is closed")
        future: Future[Completion] = Future()
        self._inbox.put((list(token_ids), params, affinity, future))
        return future

    def _key(self, affinity: Hashable) -> int:
        key = self._affine.get(affinity) if affinity is not None else None
        if key is None or key in self._futures:  # new, or its last turn still in flight: a key of its own
            key = next(self._keys)
            if affinity is not None:
                self._affine[affinity] = key
        return key

    def _loop(self) -> None:
        while True:
            waiting = []
            try:
                waiting.append(self._inbox.get(block=not self._futures))
                while True:
                    waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if None in waiting:  # closed: what is in flight or waiting fails
                for item in waiting:
                    if item is not None:
                        item[3].set_exception(RuntimeError("the turn pump closed before the turn was sampled"))
                for future in self._futures.values():
                    future.set_exception(RuntimeError("the turn pump closed before the turn came back"))
                return
            requests = []
            for ids, params, affinity, future in waiting:
                key = self._key(affinity)
                self._futures[key] = future
                requests.append(TurnRequest(key, ids, params))
            try:
                if requests:
                    self._turns.put(requests)
                done = self._turns.take() if self._futures else []
            except Exception as err:  # the engine failed: every turn in flight fails with its error
                for future in self._futures.values():
                    future.set_exception(err)
                self._futures.clear()
                # The engine may still hold those turns and return them later: their keys are never used again
                # (a late one is dropped, not taken for a new turn's).
                self._affine.clear()
                continue
            for key, completion in done:
                if key in self._futures:
                    self._futures.pop(key).set_result(completion)

    def close(self, timeout_s: float = 30.0) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(None)
            self._thread.join(timeout_s)
