"""Score completions with the configured reward functions and combine them.

    with RewardRunner(cfg.reward) as runner:
        batch = runner.score(prompts, completions, columns={"answer": answers}, completion_ids=ids)
    batch.total            # [N] weighted sum of the functions (NaN where an item failed)
    batch.failed_any       # [N] True where any function failed on the item
    batch.metrics()        # reward/mean, reward/<name>/mean, reward/<name>/failure_rate, ...

Every function runs in the worker pool (`rewards.pool`) with the
`reward.math_verify_timeout` deadline per batch, but an LLM judge (`rewards.judge`), which serves its own model on
a vLLM engine from this process, built on the first batch it scores and stopped by `close`. Items a function failed on
(it raised, hung, killed its worker, or returned the wrong length / NaN /
non-numbers) are marked failed: their value is NaN, so no score stands in for
a failure, and the RL driver drops every group holding one from the loss
(`posttrain.advantages`). Only with `reward.failure_reward` set to a number
are failures scored as that number instead (an explicit opt-in). Failures are
counted, the first message is logged, and the next batch scores normally.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rewards.config import RewardConfig
from rewards.pool import WorkerPool
from rewards.registry import SERVED, canonical, resolve

log = logging.getLogger("temper.rewards")


@dataclass
class RewardBatch:
    total: np.ndarray  # [N] float32 weighted sum; NaN where an item failed (no opt-in)
    values: dict[str, np.ndarray]  # name -> [N] unweighted values (NaN, or failure_reward, where failed)
    failed: dict[str, np.ndarray]  # name -> [N] bool
    errors: dict[str, list[str]] = field(default_factory=dict)  # name -> messages of failed shards

    @property
    def failed_any(self) -> np.ndarray:
        """[N] True where at least one function failed on the item."""
        out = np.zeros(self.total.shape, bool)
        for f in self.failed.values():
            out |= f
        return out

    def take(self, index: np.ndarray) -> RewardBatch:
        """The items at `index` (all shard messages kept)."""
        return RewardBatch(
            self.total[index],
            {k: v[index] for k, v in self.values.items()},
            {k: f[index] for k, f in self.failed.items()},
            dict(self.errors),
        )

    @staticmethod
    def concat(batches: Sequence[RewardBatch]) -> RewardBatch:
        """The items of `batches` one after another (same functions in each); messages without repeats
        (parts taken from one scored batch carry that batch's messages)."""
        names = batches[0].values
        errors: dict[str, list[str]] = {}
        for b in batches:
            for k, messages in b.errors.items():
                seen = errors.setdefault(k, [])
                seen.extend(m for m in messages if m not in seen)
        return RewardBatch(
            np.concatenate([b.total for b in batches]),
            {k: np.concatenate([b.values[k] for b in batches]) for k in names},
            {k: np.concatenate([b.failed[k] for b in batches]) for k in names},
            errors,
        )

    def plus(self, name: str, values: np.ndarray, failed: np.ndarray, errors: Sequence[str] = ()) -> RewardBatch:
        """This batch with another named reward added to the total (an environment's, per item); an item it
        failed on is NaN, as a failed function's (no value stands in for a failure)."""
        values = np.where(failed, np.float32(np.nan), np.asarray(values, np.float32))
        return RewardBatch(
            self.total + values,
            {**self.values, name: values},
            {**self.failed, name: np.asarray(failed, bool)},
            {**self.errors, **({name: list(errors)} if len(errors) else {})},
        )

    @staticmethod
    def empty(n: int) -> RewardBatch:
        """A batch of `n` items and no functions (total 0), for rewards to be added with `plus`."""
        return RewardBatch(np.zeros(n, np.float32), {}, {})

    def metrics(self) -> dict[str, float]:
        """Means and stds over the items that were scored (failed ones excluded), failure rates over all."""
        out = {
            "reward/mean": _mean(self.total),
            "reward/std": _std(self.total),
            "reward/failure_rate": float(self.failed_any.mean()) if self.total.size else 0.0,
        }
        for name, v in self.values.items():
            out[f"reward/{name}/mean"] = _mean(v)
            out[f"reward/{name}/failure_rate"] = float(self.failed[name].mean()) if v.size else 0.0
        return out


def _mean(x: np.ndarray) -> float:
    ok = x[np.isfinite(x)]
    return float(ok.mean()) if ok.size else 0.0


def _std(x: np.ndarray) -> float:
    ok = x[np.isfinite(x)]
    return float(ok.std()) if ok.size else 0.0


def function_names(specs: Sequence[str]) -> list[str]:
    """Short unique labels for metrics: the built-in or function name, suffixed when repeated."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for spec in specs:
        base = spec.rsplit(":", 1)[-1]
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


class RewardRunner:
    def __init__(self, cfg: RewardConfig, num_procs: int | None = None):
        """The configured functions, resolved, and the worker pool they (and `score_fn`'s accuracy checks) run in.
        A method without reward functions has none to `score` with (`functions` is empty)."""
        self.cfg = cfg
        self.functions = list(cfg.functions)
        self.specs = [canonical(f.fn) for f in cfg.functions]
        for spec in self.specs:
            resolve(spec)  # fail here, in the caller's process, on a name that does not resolve
        self.names = function_names([f.fn for f in cfg.functions])
        self.pool = WorkerPool(num_procs or cfg.math_verify_num_procs)
        self.served: dict[str, Any] = {}  # name -> a judge serving its own model, built on first use

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, Sequence] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> RewardBatch:
        if not self.functions:
            raise ValueError("reward.functions is empty: name at least one reward function")
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        columns = dict(columns or {})
        if completion_ids is not None:
            columns["completion_ids"] = [list(map(int, ids)) for ids in completion_ids]
        for key, col in columns.items():
            if len(col) != n:
                raise ValueError(f"reward column {key!r} has {len(col)} values for {n} completions")
        total = np.zeros(n, np.float32)
        values, failed, errors = {}, {}, {}
        for fn_cfg, spec, name in zip(self.cfg.functions, self.specs, self.names):
            raw, messages = self._run(name, spec, fn_cfg.kwargs, prompts, completions, columns, fn_cfg.timeout_s)
            bad = np.isnan(raw)
            if messages:
                errors[name] = messages
            stand_in = np.float32(np.nan if self.cfg.failure_reward is None else self.cfg.failure_reward)
            values[name], failed[name] = np.where(bad, stand_in, raw), bad
            total += fn_cfg.weight * values[name]
        return RewardBatch(total=total, values=values, failed=failed, errors=errors)

    def score_fn(
        self,
        fn: str,
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, Sequence] | None = None,
        kwargs: Mapping | None = None,
        reuse: RewardBatch | None = None,
    ) -> np.ndarray:
        """One function's values through the same pool (e.g. accuracy for metrics); NaN where it failed.

        With `reuse` (a batch `score` made of the same completions), a configured function with the
        same spec and kwargs is not run again: its values are read from that batch.
        """
        spec = canonical(fn)
        if reuse is not None:
            for fn_cfg, own, name in zip(self.cfg.functions, self.specs, self.names):
                if own == spec and fn_cfg.kwargs == dict(kwargs or {}):
                    return np.where(reuse.failed[name], np.float32(np.nan), reuse.values[name])
        resolve(spec)
        return self._run(fn, spec, dict(kwargs or {}), prompts, completions, dict(columns or {}))[0]

    def _run(
        self,
        name: str,
        spec: str,
        kwargs: Mapping,
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, Sequence],
        timeout_s: float | None = None,
    ) -> tuple[np.ndarray, list[str]]:
        """[N] float32 values (NaN where the function failed) and the failed shards' messages, logged; `timeout_s`:
        the function's own deadline (None: `reward.math_verify_timeout`)."""
        if spec in SERVED:  # a judge: its engine is the run's, not a worker's
            if name not in self.served:
                self.served[name] = resolve(spec)(**kwargs)
            raw, messages = self.served[name].score(prompts, completions, columns)
        else:
            raw, messages = self.pool.run(
                spec, kwargs, prompts, completions, columns, timeout=timeout_s or self.cfg.math_verify_timeout
            )
        values = np.array([np.nan if v is None else v for v in raw], np.float32)
        if messages:
            log.warning(
                "reward %s failed on %d/%d items (first: %s)",
                name,
                int(np.isnan(values).sum()),
                len(values),
                messages[0],
            )
        return values, messages

    def close(self) -> None:
        for judge in self.served.values():
            judge.close()
        self.served.clear()
        self.pool.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
