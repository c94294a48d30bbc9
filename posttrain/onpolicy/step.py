"""What one on-policy step carries and what it reports: the request in flight, the scored completions, the method's
batch, the step's timings, its metrics and its console line; and where a resumed run's steps start from."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.batch import TrainBatch
from posttrain.onpolicy.prompts import PromptBatch, PromptStream, columns_of, prompt_text
from posttrain.onpolicy.rollouts import Rolled, Rollouts
from rewards.runner import RewardBatch
from rollout.episodes import Episode
from rollout.sampler import Completion, SamplingParams


@dataclass
class InFlight:
    """A generation request: its prompts, and the future of their rollouts (done at once in sync mode; run in the
    background while the trainer trains in async mode; done, as stored, when restored from a checkpoint)."""

    prompts: PromptBatch
    result: Future[Rolled]

    def rolled(self) -> Rolled:
        """The rollouts, once they are done (waiting for them until then)."""
        return self.result.result()


def done(rolled: Rolled) -> Future[Rolled]:
    """A future that already holds `rolled`."""
    future: Future[Rolled] = Future()
    future.set_result(rolled)
    return future


@dataclass
class Scored:
    """A step's completions and what was made of them: rewards (None when the method has no reward functions) and
    correctness by `rl.accuracy_fn` (None without one)."""

    rows: list[dict]
    completions: list[Completion]
    rewards: RewardBatch | None
    correct: np.ndarray | None
    episodes: list[Episode] | None = None  # multi-turn rollouts: one per completion


@dataclass
class StepData:
    """What a method made of one step's scored completions: the trainer's batch, the completions and rewards the
    step's metrics describe, and the method's own metrics."""

    batch: TrainBatch | None  # None: nothing to learn from this step (no update)
    scored: Scored
    metrics: dict[str, float]
    line: str = ""  # the method's part of the step's console line


def scored_metrics(scored: Scored, staleness: int) -> dict[str, float]:
    """Rewards (mean, std, per function, failed groups), accuracy, completion lengths, truncation and staleness."""
    completions = scored.completions
    lengths = np.array([len(c.token_ids) for c in completions], float)
    out = scored.rewards.metrics() if scored.rewards is not None else {}
    if scored.correct is not None:
        out["accuracy"] = float(np.nan_to_num(scored.correct > 0).mean())
    if scored.episodes is not None:
        from posttrain.onpolicy.agent import episode_metrics

        out.update(episode_metrics(scored.episodes))
    out.update(
        {
            "completion_length/mean": float(lengths.mean()),
            "completion_length/max": float(lengths.max()),
            "truncation_rate": float(np.mean([c.finish_reason == "length" for c in completions])),
            "staleness_max": float(staleness),
        }
    )
    return out


def score(request: InFlight, rl: Any, rewards: Any, rollouts: Rollouts) -> Scored:
    """A request's rollouts, once done, with their rewards (none without reward functions or an environment's:
    `rollouts` adds an environment's) and correctness (none without `rl.accuracy_fn`), by the run's
    `rewards.runner.RewardRunner`."""
    rolled = request.rolled()
    completions = rolled.completions
    rows = request.prompts.rows
    g = rl.batch.num_generations
    prompts = [prompt_text(r, rl) for r in rows for _ in range(g)]
    texts = [c.text for c in completions]
    columns = columns_of(rows, g)
    scores = None
    if rewards.functions:
        scores = rewards.score(prompts, texts, columns, completion_ids=[c.token_ids for c in completions])
    correct = None
    if rl.accuracy_fn is not None:
        correct = rewards.score_fn(rl.accuracy_fn, prompts, texts, columns, reuse=scores)
    scores = rollouts.rewards(rolled, scores)
    return Scored(rows, completions, scores, correct, rolled.episodes)


def restored_position(meta: dict, stream: PromptStream) -> tuple[int, int, list[InFlight]]:
    """From a checkpoint's meta: (the step to resume at, the generation requests so far, which seed the sampler,
    and the requests that were in flight, their completions and episodes as stored); `stream` is set to where it
    was."""
    stream.set_state(meta["prompt_stream"])
    in_flight = [
        InFlight(
            stream.batch(f["indices"]),
            done(
                Rolled(
                    [Completion.from_record(c) for c in f["completions"]],
                    None if f.get("episodes") is None else [Episode.from_record(e) for e in f["episodes"]],
                )
            ),
        )
        for f in meta.get("in_flight", [])
    ]
    return int(meta["rl_step"]), int(meta["requests"]), in_flight


def saved_position(step: int, stream: PromptStream, requests: int, in_flight: Sequence[InFlight]) -> dict:
    """What a checkpoint's meta holds of the run's position (`restored_position` reads it back): the step, the
    prompt stream's state, the request counter, and the requests still in flight (async), waited for and stored
    with their prompts as indices into the training rows, so that a resumed run trains on exactly what an
    uninterrupted one would."""
    stored = []
    for r in in_flight:
        rolled = r.rolled()
        stored.append(
            {
                "indices": r.prompts.indices,
                "completions": [c.record() for c in rolled.completions],
                "episodes": None if rolled.episodes is None else [e.record() for e in rolled.episodes],
            }
        )
    return {"rl_step": step, "prompt_stream": stream.get_state(), "requests": requests, "in_flight": stored}


def sampling_params(
    rollout: Any, stops: Sequence[int], n: int, seed: int, temperature: float | None = None
) -> SamplingParams:
    """A step's sampling: `rollout.*` (its temperature unless `temperature`), `n` samples a prompt, the sampler's
    log-probs, ending on `stops` (the template's end of turn) as well as EOS."""
    return SamplingParams(
        n=n,
        temperature=rollout.temperature if temperature is None else temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_tokens=rollout.max_tokens,
        logprobs=True,
        seed=seed,
        stop_token_ids=tuple(stops),
    )
