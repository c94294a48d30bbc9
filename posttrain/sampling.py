"""The samplers of an RL run as one: split a batch of prompts over them, survive one dying.

    group = SamplerGroup(samplers, restart=start_sampler, resync=push_current_weights)
    pending = group.submit(prompts, params)     # returns at once for Ray samplers (async mode)
    completions = group.collect(pending)        # prompt-major, n per prompt

Samplers are `RemoteVLLMSampler`s (Ray actors; `submit` returns object
refs) or an in-process `JaxSampler` (generation happens in `submit`). When a
sampler actor dies or stops answering, `collect` starts a replacement,
loads it with the current weights (`resync`) and redoes that sampler's part
of the batch: at most the in-flight batch is regenerated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rollout.sampler import Completion, Prompt, SamplingParams

log = logging.getLogger("temper.rl")


@dataclass
class Pending:
    params: SamplingParams
    parts: list[tuple[int, list[Prompt], Any]] = field(default_factory=list)  # (sampler index, prompts, ref/result)


def _is_remote(sampler: Any) -> bool:
    return hasattr(sampler, "generate_async")


class SamplerGroup:
    def __init__(self, samplers: Sequence[Any], restart: Callable[[int], Any] | None = None,
                 resync: Callable[[Any], None] | None = None):
        if not samplers:
            raise ValueError("an RL run needs at least one sampler")
        self.samplers = list(samplers)
        self._restart = restart
        self._resync = resync
        self.restarts = 0

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> Pending:
        pending = Pending(params)
        k = len(self.samplers)
        size = -(-len(prompts) // k)
        for i, sampler in enumerate(self.samplers):
            part = list(prompts[i * size:(i + 1) * size])
            if part:
                pending.parts.append((i, part, self._start(sampler, part, params)))
        return pending

    @staticmethod
    def _start(sampler, part, params):
        return sampler.generate_async(part, params) if _is_remote(sampler) else sampler.generate(part, params)

    def collect(self, pending: Pending) -> list[Completion]:
        out: list[Completion] = []
        for i, part, ref in pending.parts:
            sampler = self.samplers[i]
            if not _is_remote(sampler):
                out.extend(ref)
                continue
            try:
                out.extend(sampler.result(ref))
            except Exception as e:  # noqa: BLE001 - a dead actor surfaces as RayActorError, a wedged one as a timeout
                if not _sampler_failure(e) or self._restart is None:
                    raise
                log.warning("sampler %d failed (%s: %s); restarting it and redoing its %d prompts",
                            i, type(e).__name__, str(e).splitlines()[0] if str(e) else "", len(part))
                print(f"sampler {i} failed ({type(e).__name__}); restarting it", flush=True)
                self.samplers[i] = self._restart(i)
                self.restarts += 1
                if self._resync is not None:
                    self._resync(self.samplers[i])
                out.extend(self.samplers[i].generate(part, pending.params))
        return out

    @property
    def policy_versions(self) -> list[int]:
        return [s.policy_version for s in self.samplers]


def _sampler_failure(e: Exception) -> bool:
    import ray.exceptions

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                          ray.exceptions.ActorUnavailableError))
