"""The samplers of an RL run as one: split a batch of prompts over them, survive one failing.

    group = SamplerGroup(samplers, restart=start_sampler)
    pending = group.submit(prompts, params)     # returns at once for Ray samplers (async mode)
    completions = group.collect(pending, push)  # prompt-major, n per prompt
    group.sync(push)                            # push(sampler): the trainer's current weights into it

Samplers are `rollout.sampler.Sampler`s: `RemoteVLLMSampler`s (Ray actors;
`submit` returns object refs) or an in-process `JaxSampler` (generation
happens in `submit`). Each
sampler gets a contiguous slice of the prompts and `prompt_offset` says where
its slice starts, so per-sample seeds do not depend on the split
(`rollout.sampler.sample_seed`).

A sampler *fails* when its actor dies, stops answering within the timeout, or
its engine raises (an out-of-memory error, say). Then `collect` (or `sync`)
starts a replacement in its place, loads it with the trainer's current weights
(`push`) and redoes that sampler's share of the request once; if the
replacement fails too, `SamplerFailed` stops the run (resume it with the same
command). A sampler whose node has left the cluster is not restarted: it is
dropped, its share redone by a surviving sampler, and the run goes on with the
rest (`dropped`); only when none is left does the run stop. A `ValueError`
raised by a sampler's generate is bad input (a prompt longer than the model
allows), not a failure: it stops the run as a `SamplerInputError` with the
sampler's message.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from core.errors import TemperError, UserError
from rollout.sampler import Completion, Prompt, Sampler, SamplingParams

log = logging.getLogger("temper.rl")


class SamplerFailed(TemperError, RuntimeError):
    """A sampler failed again right after being restarted: the run stops (and resumes from its checkpoint)."""


class SamplerInputError(UserError, ValueError):
    """A sampler refused its prompts (e.g. longer than rollout.max_model_len allows): the data's problem."""


@dataclass
class Part:
    index: int  # which sampler slot
    sampler: Sampler  # the sampler it was submitted to (the slot may hold a replacement by collection time)
    prompts: list[Prompt]
    params: SamplingParams
    ref: Any  # the sampler's ticket: an object ref (Ray) or the completions themselves (in-process)


@dataclass
class Pending:
    parts: list[Part] = field(default_factory=list)


class SamplerGroup:
    def __init__(self, samplers: Sequence[Sampler], restart: Callable[[int], Sampler] | None = None):
        """`restart(slot)` starts a sampler in place of slot `slot`'s (its placement bundle and seed)."""
        if not samplers:
            raise ValueError("an RL run needs at least one sampler")
        self.samplers = list(samplers)
        self.slots = list(range(len(samplers)))  # each sampler's slot (what `restart` takes), as samplers drop out
        self._restart = restart
        # What became of each failed sampler, the failed one kept with it (a freed object's id could be reused).
        self._successor: dict[int, tuple[Sampler, Sampler]] = {}  # id(failed) -> (failed, its replacement)
        self._dropped: dict[int, Sampler] = {}  # id(sampler) -> sampler, of those dropped with their node
        self.restarts = 0  # samplers replaced so far
        self.dropped = 0  # samplers dropped with their node
        self.redone_prompts = 0  # prompts generated again because their sampler failed

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> Pending:
        pending = Pending()
        size = -(-len(prompts) // len(self.samplers))
        for i, (slot, sampler) in enumerate(zip(self.slots, self.samplers, strict=True)):
            lo = i * size
            part = list(prompts[lo : lo + size])
            if part:
                own = dataclasses.replace(params, prompt_offset=params.prompt_offset + lo)
                pending.parts.append(Part(slot, sampler, part, own, self._start(sampler, part, own)))
        return pending

    @staticmethod
    def _start(sampler: Sampler, part: list[Prompt], params: SamplingParams) -> Any:
        return sampler.submit(part, params)

    def collect(self, pending: Pending, push: Callable[[Any], Any]) -> list[Completion]:
        """Every part's completions in prompt order; a failed sampler is replaced (loaded with `push`), or dropped
        with its node, and its part generated again, once, by the sampler that took over."""
        out: list[Completion] = []
        for part in pending.parts:
            if not part.sampler.remote:  # generated in `submit`; its errors were raised there
                out.extend(part.sampler.result(part.ref))
                continue
            try:
                out.extend(part.sampler.result(part.ref))
            except Exception as e:
                sampler = self.take_over(part.sampler, e, push)
                self.redone_prompts += len(part.prompts)
                out.extend(self._once(part.index, partial(sampler.generate, part.prompts, part.params)))
        return out

    def take_over(self, failed: Sampler, error: Exception, push: Callable[[Any], Any]) -> Sampler:
        """The sampler that does the work `failed` raised `error` on (a replacement, loaded with `push`, or a
        survivor when its node left); bad input (a ValueError inside the sampler) is raised as
        `SamplerInputError`, and what is not a sampler failure as it is."""
        cause = getattr(error, "cause", None)
        if isinstance(cause, ValueError):
            slot = self.slots[self.samplers.index(failed)] if failed in self.samplers else "?"
            raise SamplerInputError(f"sampler {slot} refused its prompts: {cause}") from None
        if not is_sampler_failure(error) or self._restart is None:
            raise error
        return self._take_over(failed, error, push)

    def sync(self, push: Callable[[Any], Any]) -> list[Any]:
        """`push(sampler)` for every sampler (the trainer's weights into it); a sampler that fails meanwhile
        is replaced and loaded once more, or dropped with its node. Returns what `push` returned, per sampler
        loaded."""
        out = []
        for sampler in list(self.samplers):
            try:
                out.append(push(sampler))
            except Exception as e:
                if not sampler.remote or not is_sampler_failure(e) or self._restart is None:
                    raise
                successor = self._take_over(sampler, e, push, loaded=True)
                if successor is not None:
                    out.append(successor)
        return out

    def _take_over(self, failed: Sampler, error: Exception, push: Callable[[Any], Any], loaded: bool = False):
        """The sampler that does `failed`'s work from now on: a replacement in its slot, started and loaded with
        the current weights (with `loaded`: what `push` returned for it), or, when `failed`'s node has left the
        cluster, a surviving sampler (with `loaded`: None, the survivors hold the weights already)."""
        if id(failed) in self._dropped:  # dropped with its node earlier: a survivor does its work
            return None if loaded else self.samplers[0]
        if id(failed) in self._successor:  # replaced by an earlier part of this request
            successor = self._successor[id(failed)][1]
            slot = self.slots[self.samplers.index(successor)]
            return self._once(slot, lambda: push(successor)) if loaded else successor
        slot = self.slots[self.samplers.index(failed)]
        first = str(error).splitlines()[0] if str(error) else ""
        failed.stop()  # an engine that raised may still hold its memory
        if not failed.node_alive():
            return self._drop(failed, slot, error, loaded)
        log.warning("sampler %d failed (%s: %s); restarting it", slot, type(error).__name__, first)
        print(f"sampler {slot} failed ({type(error).__name__}); restarting it", flush=True)
        assert self._restart is not None  # callers check before replacing
        try:
            successor = self._once(slot, partial(self._restart, slot))
        except SamplerFailed:
            # A node that crashed (rather than left) is seen dead by Ray only after its health checks fail,
            # which the restart's wait outlasts: asked again now, a dead node's sampler is dropped.
            if failed.node_alive():
                raise
            return self._drop(failed, slot, error, loaded)
        self.samplers[self.samplers.index(failed)] = successor
        self._successor[id(failed)] = (failed, successor)
        self.restarts += 1
        stats = self._once(slot, lambda: push(successor))
        return stats if loaded else successor

    def _drop(self, failed: Sampler, slot: int, error: Exception, loaded: bool) -> Sampler | None:
        """Leave out a sampler whose node is gone; the first survivor takes over its work."""
        i = self.samplers.index(failed)
        del self.samplers[i], self.slots[i]
        self.dropped += 1
        self._dropped[id(failed)] = failed
        if not self.samplers:
            raise SamplerFailed(
                f"sampler {slot}'s node left the cluster ({type(error).__name__}) and no sampler is left; run the "
                "same command again, on a cluster with room for the samplers, to resume from the last checkpoint"
            )
        log.warning("sampler %d's node left the cluster; dropped, %d sampler(s) go on", slot, len(self.samplers))
        print(f"sampler {slot}'s node left the cluster: dropped, {len(self.samplers)} sampler(s) go on", flush=True)
        return None if loaded else self.samplers[0]

    @staticmethod
    def _once(i: int, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as e:
            if not is_sampler_failure(e):
                raise
            raise SamplerFailed(
                f"sampler {i} failed again right after a restart ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); stopping. Run the same command "
                f"again to resume from the last checkpoint."
            ) from e

    @property
    def policy_versions(self) -> list[int]:
        return [s.policy_version for s in self.samplers]


def is_sampler_failure(e: BaseException) -> bool:
    """An actor death, a call past its timeout, or an engine error raised inside the actor (but not bad input:
    a ValueError inside is raised as it is)."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.RayTaskError):
        return not isinstance(e.cause, ValueError)
    return isinstance(
        e, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError)
    )
