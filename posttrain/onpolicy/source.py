"""Where an on-policy run's batches come from: prompts -> rollouts -> rewards -> the method's batch; after each
update, the trainer's weights to the samplers.

    source = SamplerSource(cfg, method, trainer, rewards, rollouts, stream, tokenizer, turn_stops, row_len,
                           row_multiple, eval_rows)
    source.start(placement, run_dir / "rollout_init_hf", tokenizer_dir)  # the samplers, sent the trainer's weights
    drawn = source.next()                    # the next step's batch (the method's StepData), its metrics
    metrics = source.after_update(trainer)   # the weight sync (when the step trained), its time and bytes
    meta, _ = source.checkpoint()            # the step, the prompt stream, the request counter, what is in flight
    held_out = source.evaluate(trainer)      # greedy pass@1, pass@k and maj@k on the held-out prompts

The samplers' kind of `core.batch_source.BatchSource`, as `core.batch_source.DatasetSource` is the dataset's: a
batch per step, told of every update, with a position a checkpoint keeps (`checkpoint`, restored by `restore`) from
which a resumed run draws exactly what an uninterrupted one would. Sync (`rl.off_policy_steps = 0`) samples on the
current policy; async (`d > 0`) keeps d requests in flight, each at most d policy versions old (checked on every
batch). A request is a `step.InFlight`: the future of its rollouts (`rollouts.Rollouts`: a single turn each, or
whole episodes with `rl.agent`; one path for both), done at once when sync, run in a background thread while the
trainer trains when async.

The trainer's calls from both threads of an async run (a sampler restarted in the background thread is loaded with
the trainer's weights) go one at a time, under `lock`, so that a trainer group's processes see one order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.batch_source import Drawn
from core.loop import Plot
from posttrain.config import PostTrainConfig
from posttrain.losses.entropy_control import EntropyControl
from posttrain.onpolicy.checks import check_staleness
from posttrain.onpolicy.evaluation import held_out_metrics
from posttrain.onpolicy.method import SampleContext, SamplingMethod
from posttrain.onpolicy.prompts import PromptBatch, PromptStream
from posttrain.onpolicy.rl_batch import RLBatch
from posttrain.onpolicy.rollouts import Rollouts
from posttrain.onpolicy.step import (
    InFlight,
    done,
    restored_position,
    sampling_params,
    saved_position,
    score,
    scored_metrics,
)
from posttrain.onpolicy.workers import episode_turns, start_samplers
from posttrain.trainer import TrainerHandle
from rewards.runner import RewardRunner
from rollout.background import Background
from rollout.engine_programs import EnginePrograms
from rollout.group import SamplerGroup
from rollout.placement import Placement
from rollout.sampler import Completion, Prompt, Sampler, SamplingParams, sample_seed
from rollout.turns import Turns
from rollout.weight_sync import SyncStats


def entropy_control(cfg: PostTrainConfig) -> EntropyControl | None:
    """`rl.loss`'s adaptive entropy control, at its start (None: a fixed coefficient or none)."""
    loss = cfg.rl.loss
    if loss.entropy_target is None or loss.entropy_coef_range is None:
        return None
    lo, hi = loss.entropy_coef_range
    return EntropyControl(loss.entropy_coef, loss.entropy_target, lo, hi, loss.entropy_coef_delta)


# What the console line shows of a step's metrics (the method's own words follow them).
CONSOLE = {
    "reward/mean": "reward",
    "accuracy": "acc",
    "reward/failed_groups": "failed groups",
    "completion_length/mean": "len",
    "time/generate_s": "gen s",
    "time/sync_s": "sync s",
}


class SamplerSource:
    """The samplers' batches (module docstring)."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        method: SamplingMethod,
        trainer: TrainerHandle,
        rewards: RewardRunner,
        rollouts: Rollouts,
        stream: PromptStream,
        tokenizer: Any,
        turn_stops: Sequence[int],
        row_len: int,
        row_multiple: int,
        eval_rows: Sequence[dict] = (),
    ):
        """`eval_rows`: the held-out prompts `evaluate` reads (the first `rl.eval_prompts`)."""
        self.cfg, self.method, self.trainer = cfg, method, trainer
        self.rewards, self.rollouts, self.stream = rewards, rollouts, stream
        self.tokenizer, self.turn_stops = tokenizer, tuple(turn_stops)
        self.row_len, self.row_multiple = row_len, row_multiple
        self.eval_rows = list(eval_rows)
        self.console = dict(CONSOLE)
        self.plots: Sequence[Plot] = method.plots(cfg)
        self.lock = threading.Lock()  # the trainer's calls, one at a time (module docstring)
        self.step = 0  # the step of the latest batch
        self.requests = 0  # generation requests so far (seeds the sampler)
        self.in_flight: deque[InFlight] = deque()
        self.samplers: SamplerGroup | None = None
        self.engine_programs = EnginePrograms()  # the JAX sampler's multi-turn programs, shared by every step
        self.background: Background | None = None  # async rollouts' thread (`start`)
        self.placement: Placement | None = None
        self.init_hf: Path | None = None  # the Hugging Face directory vLLM engines started from (`start`)
        self._trained = False  # whether the latest batch was trained on: its update is synced (`after_update`)
        self.entropy = entropy_control(cfg)  # adaptive entropy control's state (None: a fixed coefficient)

    def start(self, placement: Placement | None, init_hf: Path, tokenizer_dir: str) -> Path | None:
        """Start the samplers, each sent the trainer's weights; the Hugging Face directory vLLM engines started
        from (None with the JAX sampler)."""
        self.placement = placement
        self.samplers, self.init_hf = start_samplers(
            self.cfg, self.trainer, placement, init_hf, tokenizer_dir, self.push
        )
        if self.cfg.rl.off_policy_steps > 0:
            # Async: rollouts run in this thread, a request's at a time, while the trainer trains.
            self.background = Background("rollouts")
        return self.init_hf

    def _group(self) -> SamplerGroup:
        assert self.samplers is not None, "start() first"
        return self.samplers

    # ---------------------------------------------------------------- position

    position = None  # nothing a trainer's restore sets in place: the position is the checkpoint's meta

    def restore(self, step: int, meta: dict) -> int:
        """Where a checkpoint's meta says the source was (`checkpoint`); the step to resume at."""
        self.step, self.requests, in_flight = restored_position(meta, self.stream)
        if self.entropy is not None and meta.get("entropy_control") is not None:
            self.entropy = EntropyControl.from_state(meta["entropy_control"])
        self.in_flight = deque(in_flight)
        return self.step

    def checkpoint(self) -> tuple[dict, None]:
        """The position a checkpoint keeps, as its meta: the step of the latest batch, the prompt stream, the
        request counter and the requests in flight, collected (`step.saved_position`); adaptive entropy control's
        state."""
        meta = saved_position(self.step, self.stream, self.requests, self.in_flight)
        if self.entropy is not None:
            meta["entropy_control"] = self.entropy.state()
        return meta, None

    # ----------------------------------------------------------------- weights

    def push(self, sampler: Sampler) -> SyncStats:
        """The trainer's current weights and policy version into one sampler."""
        with self.lock:
            stats = self.trainer.sync(sampler)
        sampler.policy_version = stats.version
        return stats

    def after_update(self, trainer: Any = None, metrics: dict[str, float] | None = None) -> dict[str, float]:
        """The weight sync after a step that trained (none after one that did not: the samplers hold these weights)
        and the samplers' state: `time/sync_s`, `sync/bytes` (sent to all samplers), `policy_version` (the first
        sampler's), restarts and redone prompts. The weights come from the trainer this source was built with
        (`push`: a restarted sampler is loaded the same way), whatever `trainer` is. Adaptive entropy control
        hears the step's entropy (`metrics`)."""
        if self.entropy is not None and self._trained and metrics is not None:
            self.entropy.update(float(metrics.get("entropy", float("nan"))))
        seconds, sent = 0.0, 0
        if self._trained:
            self.settle()  # not timed here: the wait for episodes still running is generation's
            start = time.perf_counter()
            stats = self._group().sync(self.push)
            seconds, sent = time.perf_counter() - start, sum(s.bytes for s in stats)
        group = self._group()
        return {
            "time/sync_s": seconds,
            "sync/bytes": float(sent),
            "policy_version": float(group.policy_versions[0]),
            "sampler_restarts": float(group.restarts),
            "sampler_redone_prompts": float(group.redone_prompts),
        }

    def settle(self) -> None:
        """Wait for the rollouts running in the background (async): each request's rollouts run whole on the
        weights they started on (an engine takes a weight update only between requests), whatever the timing."""
        for request in self.in_flight:
            request.rolled()

    # ----------------------------------------------------------------- batches

    def next(self) -> Drawn:
        """The next step's batch: the next request's completions (sampled now, or in flight since an earlier
        step), scored and made into the method's batch; the requests that keep `rl.off_policy_steps` in flight
        are submitted first. Its metrics: rewards, accuracy, lengths, staleness (`step.scored_metrics`), the
        method's, and the time spent generating (or waiting for what was in flight) and scoring."""
        rl = self.cfg.rl
        self.step += 1
        t0 = time.perf_counter()
        while len(self.in_flight) < 1 + rl.off_policy_steps:
            self.in_flight.append(self._submit(next(self.stream)))
        request = self.in_flight.popleft()
        completions = request.rolled().completions
        generate_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        with self.lock:
            version = self.trainer.version()
        staleness = check_staleness(completions, version, rl.off_policy_steps)
        more = lambda: score(self._submit(next(self.stream)), rl, self.rewards, self.rollouts)  # DAPO's refill
        ctx = SampleContext(self.step, self.row_len, self.row_multiple, self.tokenizer, more)
        data = self.method.from_samples(self.cfg, score(request, rl, self.rewards, self.rollouts), ctx)
        self._trained = data.batch is not None
        control = {}
        if self.entropy is not None and isinstance(data.batch, RLBatch):  # the coefficient rides with the batch
            coef = self.entropy.applied()
            data.batch = data.batch.replace(entropy_coef=np.full(np.shape(data.batch.advantages), coef, np.float32))
            control = {"entropy_coef": coef, "entropy_control/coef": self.entropy.coef}
        tokens = sum(len(c.token_ids) for c in data.scored.completions)
        metrics = {
            **scored_metrics(data.scored, staleness),
            **data.metrics,
            "time/generate_s": generate_s,
            "time/reward_s": time.perf_counter() - t1,
            "generate_tokens_per_s": tokens / max(generate_s, 1e-9),
            **control,
        }
        return Drawn(data.batch, metrics, data.line, data)

    def sampling_params(self, n: int, seed: int, temperature: float | None = None) -> SamplingParams:
        return sampling_params(self.cfg.rollout, self.turn_stops, n, seed, temperature)

    def _submit(self, prompts: PromptBatch) -> InFlight:
        # Every request has its own seed, from the run seed and a counter that a resumed run restores (the
        # sampler derives one per prompt and sample from it): a restarted run draws what an uninterrupted one would.
        self.requests += 1
        seed = sample_seed(self.cfg.run.seed, self.requests)
        params = self.sampling_params(self.cfg.rl.batch.num_generations, seed)
        if self.background is not None:  # async: they run while the trainer trains
            return InFlight(prompts, self.background.submit(self.rollouts.run, prompts.rows, params, self))
        return InFlight(prompts, done(self.rollouts.run(prompts.rows, params, self)))

    # The run's samplers as a rollout sees them (`rollouts.Samplers`).

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of each prompt, now, from the sampler group (a failed sampler replaced)."""
        group = self._group()
        return group.collect(group.submit(prompts, params), self.push)

    def turns(self, episodes: int) -> Turns:
        """The samplers as an episode runner's turns, for `episodes` episodes."""
        stop = self.background.cancelled if self.background is not None else None
        return episode_turns(self.cfg, self._group(), self.push, episodes, stop, self.engine_programs)

    # -------------------------------------------------------------- evaluation

    @property
    def evaluates(self) -> bool:
        """Whether there is anything to evaluate: held-out prompts and `rl.accuracy_fn` to judge them."""
        return bool(self.eval_rows[: self.cfg.rl.eval_prompts]) and self.cfg.rl.accuracy_fn is not None

    def evaluate(self, trainer: Any = None) -> dict[str, float]:
        """Greedy pass@1, sampled pass@k (unbiased) and maj@k on the held-out prompts, by `rl.accuracy_fn`."""
        rl = self.cfg.rl
        if not self.evaluates:
            return {}
        rows = self.eval_rows[: rl.eval_prompts]
        k = rl.eval_samples
        self.settle()  # the engines serve one set of episodes at a time
        greedy_params = self.sampling_params(1, 0, temperature=0.0)
        sampled_params = self.sampling_params(k, self.cfg.run.seed)
        greedy = self.rollouts.run(rows, greedy_params, self).completions
        sampled = self.rollouts.run(rows, sampled_params, self).completions
        return held_out_metrics(rows, rl, greedy, sampled, self.rewards)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the rollouts running in the background (before the pool and samplers they use go)."""
        if self.background is not None:
            self.background.close(timeout_s)
