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
command). A `ValueError` raised by a sampler's generate is bad input (a
prompt longer than the model allows), not a failure: it stops the run as a
`SamplerInputError` with the sampler's message.
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
        if not samplers:
            raise ValueError("an RL run needs at least one sampler")
        self.samplers = list(samplers)
        self._restart = restart
        self.restarts = 0  # samplers replaced so far
        self.redone_prompts = 0  # prompts generated again because their sampler failed

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> Pending:
        pending = Pending()
        size = -(-len(prompts) // len(self.samplers))
        for i, sampler in enumerate(self.samplers):
            lo = i * size
            part = list(prompts[lo : lo + size])
            if part:
                own = dataclasses.replace(params, prompt_offset=params.prompt_offset + lo)
                pending.parts.append(Part(i, sampler, part, own, self._start(sampler, part, own)))
        return pending

    @staticmethod
    def _start(sampler: Sampler, part: list[Prompt], params: SamplingParams) -> Any:
        return sampler.submit(part, params)

    def collect(self, pending: Pending, push: Callable[[Any], Any]) -> list[Completion]:
        """Every part's completions in prompt order; a failed sampler is replaced (loaded with `push`) and its
        part generated again, once."""
        out: list[Completion] = []
        for part in pending.parts:
            if not part.sampler.remote:  # generated in `submit`; its errors were raised there
                out.extend(part.sampler.result(part.ref))
                continue
            try:
                out.extend(part.sampler.result(part.ref))
            except Exception as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, ValueError):
                    raise SamplerInputError(f"sampler {part.index} refused its prompts: {cause}") from None
                if not is_sampler_failure(e) or self._restart is None:
                    raise
                sampler = self._replace(part.index, part.sampler, e, push)
                self.redone_prompts += len(part.prompts)
                out.extend(self._once(part.index, partial(sampler.generate, part.prompts, part.params)))
        return out

    def sync(self, push: Callable[[Any], Any]) -> list[Any]:
        """`push(sampler)` for every sampler (the trainer's weights into it); a sampler that fails meanwhile
        is replaced and loaded once more. Returns what `push` returned, per sampler."""
        out = []
        for i in range(len(self.samplers)):
            sampler = self.samplers[i]
            try:
                out.append(push(sampler))
            except Exception as e:
                if not sampler.remote or not is_sampler_failure(e) or self._restart is None:
                    raise
                out.append(self._replace(i, sampler, e, push, loaded=True))
        return out

    def _replace(self, i: int, failed: Any, error: Exception, push: Callable[[Any], Any], loaded: bool = False):
        """The sampler in slot i, replaced if it is still the one that failed, loaded with the current weights.
        Returns the new sampler (or, with `loaded`, what `push` returned for it)."""
        if self.samplers[i] is failed:  # not yet replaced by an earlier part of this request
            first = str(error).splitlines()[0] if str(error) else ""
            log.warning("sampler %d failed (%s: %s); restarting it", i, type(error).__name__, first)
            print(f"sampler {i} failed ({type(error).__name__}); restarting it", flush=True)
            failed.stop()  # an engine that raised may still hold its memory
            assert self._restart is not None  # callers check before replacing
            self.samplers[i] = self._once(i, partial(self._restart, i))
            self.restarts += 1
            stats = self._once(i, lambda: push(self.samplers[i]))
            return stats if loaded else self.samplers[i]
        return self._once(i, lambda: push(self.samplers[i])) if loaded else self.samplers[i]

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
