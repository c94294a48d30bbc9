"""The on-policy run: sample -> score -> the method's batch -> train -> sync weights, on Ray or in one process.

    summary = run_to_end(OnPolicyRun(cfg, posttrain.grpo.GRPO))     # python -m recipes.grpo CONFIG.yml
    summary = run_to_end(OnPolicyRun(cfg, posttrain.dpo.online.ONLINE_DPO))   # the same run, another method

`OnPolicyRun` drives three parts through typed interfaces: samplers (`rollout.group.SamplerGroup` of
`rollout.sampler.Sampler`s), reward functions (`rewards.runner.RewardRunner`; optional: a method may need none)
and the trainer (`posttrain.trainer.TrainerHandle`, hosting the method's `core.method_learner.MethodLearner`). The
method is a `posttrain.onpolicy.method.SamplingMethod`: what it checks of the config (`check`), what it makes of
each step's scored completions (`from_samples` -> `StepData`, its batch any `core.batch.TrainBatch`), how long
its packed rows are (`row_length`), and what trains and how (its `core.method.Method` part, in the trainer): GRPO
(`posttrain.grpo`) makes group advantages into a policy-gradient `RLBatch`; online DPO (`posttrain.dpo.online`)
makes best / worst pairs.

Modes (`rollout.sampler`, [grpo.md](../../docs/grpo.md)): `vllm`, the trainer and the samplers Ray actors in one
placement group, weights streamed after every update; `jax`, single controller, trainer and sampler in this process
on disjoint sub-meshes. Sync (`rl.off_policy_steps = 0`) trains on the current policy's completions; async (`d > 0`,
vLLM) keeps d batches in flight, each at most d policy versions old (checked every step).

The run is a `core.loop.Loop`, the one loop the offline methods run in too: its hooks, NaN policy, SIGTERM and
end are that loop's; what is this run's is where batches come from (`train_step`: sample, score, the method's
batch, the trainer's step, a weight sync). Every step logs (reward mean/std, total and per function, accuracy,
completion length, truncation rate, the method's metrics: clip fraction, KL, entropy, the sampler/trainer
mismatch, staleness, a time breakdown); `train.eval_every` evaluates on the held-out prompts;
`checkpoint.every_steps`, the last step and SIGTERM checkpoint (policy, optimizer, step, policy version,
prompt-stream position, sampling-seed counter and, in async mode, the completions still in flight), from which the
run resumes exactly where an uninterrupted one would be; the end exports a Hugging Face directory and plots the
curves. The tokenizer is the offline methods' (`core.tokenizer.run_tokenizer`: `data.tokenizer_dir`, the initial
checkpoint's, else one trained on the prompt rows), checked before Ray or an engine starts.

Failures (the table in docs/grpo.md): a failed reward item drops its group, a failed sampler is restarted and its
share redone once, a dead trainer stops the run (`TrainerUnavailable`), a non-finite loss follows
`train.nan_policy`; each a message, not a traceback, from the recipe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from core.chat_template import turn_stop_ids
from core.compile_cache import CompileTally, use_compile_cache
from core.config import ModelConfig
from core.config_loader import save_config
from core.data import load_tokenizer
from core.goodput import RunStart
from core.loop import Hook, Loop, Plot
from core.metrics import MetricsLogger
from core.tokenizer import check_vocab, run_tokenizer
from posttrain.config import PostTrainConfig
from posttrain.fit import RunSummary
from posttrain.onpolicy.agent import AgentRollouts
from posttrain.onpolicy.checks import check_config, check_policy, check_staleness, check_tokenizer_template
from posttrain.onpolicy.evaluation import held_out_metrics
from posttrain.onpolicy.method import SampleContext, SamplingMethod
from posttrain.onpolicy.prompts import PromptBatch, PromptStream, prompt_rows, render_prompt
from posttrain.onpolicy.step import (
    InFlight,
    Scored,
    StepTimes,
    restored_position,
    sampling_params,
    saved_position,
    score,
    scored_metrics,
    step_line,
)
from posttrain.onpolicy.workers import episode_turns, release, start_samplers, workers_to_release
from posttrain.trainer import start_trainer
from rewards.runner import RewardRunner
from rollout.background import Background
from rollout.engine_programs import EnginePrograms
from rollout.group import Pending
from rollout.placement import Placement, reserve
from rollout.sampler import Completion, Prompt, Sampler, SamplingParams, sample_seed
from rollout.turns import Turns
from rollout.weight_sync import SyncStats


class OnPolicyRun(Loop):
    """Sampling, rewards, the trainer, weight sync, evaluation and checkpoints, shared by every on-policy
    method (`posttrain.grpo.GRPO`, `posttrain.dpo.online.ONLINE_DPO`, ...): the method turns scored completions
    into its batch (`from_samples`) and says what trains and how (the trainer hosts it). The loop itself (hooks,
    NaN policy, SIGTERM, the end) is `core.loop.Loop`'s, as the offline methods'."""

    cfg: PostTrainConfig

    def __init__(self, cfg: PostTrainConfig, method: SamplingMethod):
        started = RunStart.now()
        use_compile_cache(cfg.compile.cache_dir)  # the JAX sampler's, in this process (the trainer's: its own)
        # The trainer's calls from both threads of an async multi-turn run (a sampler restarted in the episode thread
        # is loaded with the trainer's weights): one at a time, so that a trainer group's processes see one order.
        self._trainer_lock = threading.Lock()
        self._background: Background | None = None
        check_config(cfg)
        method.check(cfg)
        self.method = method
        run_dir = Path(cfg.run.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        save_config(cfg, run_dir)
        rl, rollout = cfg.rl, cfg.rollout
        self.cfg = cfg
        self.row_len = method.row_length(cfg)
        self.train_rows, self.eval_rows = prompt_rows(cfg)
        self.tokenizer_dir = run_tokenizer(cfg, lambda: method.tokenizer_texts(self.train_rows))
        check_tokenizer_template(self.tokenizer_dir, rl.use_chat_template)
        self.tokenizer = load_tokenizer(self.tokenizer_dir)  # read once: the checks, the stops, the method's batches
        method.check_tokenizer(cfg, self.tokenizer)
        # Chat prompts and episodes: a completion (a turn) ends on the template's end of turn, not only on EOS.
        chat = rl.use_chat_template or rl.agent is not None
        self.turn_stops = turn_stop_ids(self.tokenizer) if chat else ()
        self.stream = PromptStream(
            self.train_rows, rl.batch.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
        self.rewards = RewardRunner(cfg.reward)
        # Multi-turn rollouts: the environment, tool parser and template are checked here, before Ray starts.
        self.agent = AgentRollouts(cfg, self.tokenizer_dir, self.rewards.pool) if rl.agent is not None else None
        self.placement: Placement | None = None
        if rollout.sampler == "vllm":
            from rollout.ray import ensure_ray

            ensure_ray()
            self.placement = reserve(cfg)
        self.trainer = start_trainer(cfg, run_dir, method, self.placement)
        check_vocab(self.trainer.model_config()["vocab_size"], self.tokenizer_dir)
        check_policy(cfg, ModelConfig.model_validate(self.trainer.model_config()))
        self.row_multiple = self.trainer.batch_shards()  # the trainer's data-parallel size
        start_step = 0
        self._requests = 0  # generation requests so far (seeds the sampler)
        resumed_in_flight: list[InFlight] = []
        restored = self.trainer.restore_latest()
        if restored is not None:
            step, meta = restored
            start_step, self._requests, resumed_in_flight = restored_position(meta, self.stream)
            print(
                f"resumed from {run_dir / 'checkpoints' / str(step)} at step {start_step} "
                f"(policy version {meta['policy_version']})",
                flush=True,
            )
        self._saved = start_step if restored is not None else None
        # init_hf: the Hugging Face directory vLLM engines started from (None with the JAX sampler)
        self.samplers, self.init_hf = start_samplers(
            cfg, self.trainer, self.placement, run_dir / "rollout_init_hf", self.tokenizer_dir, self._push
        )
        super().__init__(cfg, run_dir, start_step, started=started)
        self._trainer_compile = CompileTally()  # the step's, in the trainer's own process (a Ray actor)
        self._engine_programs = EnginePrograms()  # the JAX sampler's multi-turn programs, shared by every step
        self.metrics = MetricsLogger(run_dir, cfg.logging, cfg.train.steps, resume_step=start_step)
        self.final_eval: dict | None = None
        self._in_flight: deque[InFlight] = deque(resumed_in_flight)
        # Async multi-turn rollouts: episodes run in this thread, one request's at a time, while the trainer trains.
        self._background = Background("episodes") if self.agent and rl.off_policy_steps else None

        self._last_line = ""
        self._last_metrics: dict[str, float] = {}
        self._hf_dir: Path | None = None

    @property
    def plots(self) -> Sequence[Plot]:  # type: ignore[override]
        return self.method.plots(self.cfg)

    # ---------------------------------------------------------------- weights

    def _push(self, sampler: Sampler) -> SyncStats:
        """The trainer's current weights and policy version into one sampler."""
        with self._trainer_lock:
            stats = self.trainer.sync(sampler)
        sampler.policy_version = stats.version
        return stats

    def _sync(self) -> tuple[float, int]:
        """(seconds, bytes sent to all samplers) of one weight sync."""
        self._settle()  # not timed here: the wait for episodes still running is generation's
        start = time.perf_counter()
        stats = self.samplers.sync(self._push)
        return time.perf_counter() - start, sum(s.bytes for s in stats)

    def _settle(self) -> None:
        """Wait for the episodes running in the background (async `rl.agent`): each request's episodes run whole
        on the weights they started on, as a request's completions do (an engine takes a weight update only
        between requests), whatever the timing."""
        for request in self._in_flight:
            if isinstance(request.result, Future):
                self._collect(request)

    # ------------------------------------------------------------------ steps

    def sampling_params(self, n: int, seed: int, temperature: float | None = None) -> SamplingParams:
        return sampling_params(self.cfg.rollout, self.turn_stops, n, seed, temperature)

    def _submit(self, prompts: PromptBatch) -> InFlight:
        # Every request has its own seed, from the run seed and a counter that a resumed run restores (the
        # sampler derives one per prompt and sample from it): a restarted run draws what an uninterrupted one would.
        self._requests += 1
        seed = sample_seed(self.cfg.run.seed, self._requests)
        params = self.sampling_params(self.cfg.rl.batch.num_generations, seed)
        if self.agent is not None and self._background is not None:  # async: they run while the trainer trains
            return InFlight(
                prompts,
                self._background.submit(
                    self.agent.run, prompts.rows, params, self._turns(len(prompts.rows) * params.n)
                ),
            )
        if self.agent is not None:  # episodes run to their end here (sync mode)
            completions, episodes = self.agent.run(prompts.rows, params, self._turns(len(prompts.rows) * params.n))
            return InFlight(prompts, completions, episodes)
        rendered = [render_prompt(r, self.cfg.rl) for r in prompts.rows]
        return InFlight(prompts, self.samplers.submit(rendered, params))

    def _generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self.samplers.collect(self.samplers.submit(prompts, params), self._push)

    def _turns(self, episodes: int) -> Turns:
        stop = self._background.cancelled if self._background is not None else None
        return episode_turns(self.cfg, self.samplers, self._push, episodes, stop, self._engine_programs)

    def _collect(self, request: InFlight) -> list[Completion]:
        if isinstance(request.result, Future):
            request.result, request.episodes = request.result.result()
        if isinstance(request.result, list):
            return request.result
        assert isinstance(request.result, Pending)
        request.result = self.samplers.collect(request.result, self._push)
        return request.result

    def _score(self, request: InFlight) -> Scored:
        return score(request, self._collect(request), self.cfg.rl, self.rewards, self.agent)

    def run(self, on_step=None) -> RunSummary:
        """Train to `train.steps`. `on_step(run, step, metrics)` is called after every step (tests, notebooks)."""
        if on_step is not None:
            self.hooks.append(Hook("on_step", 1, lambda run, step: on_step(run, step, run._last_metrics)))
        try:
            step = self.fit()
        finally:
            if on_step is not None:
                self.hooks.pop()
        return RunSummary(self.run_dir, step, self.trainer.version(), self.final_eval, self._hf_dir)

    def train_step(self, step: int) -> None:
        """One step: sample (or collect what is in flight), score, the method's batch, train, sync."""
        rl = self.cfg.rl
        t0 = time.perf_counter()
        while len(self._in_flight) < 1 + rl.off_policy_steps:
            self._in_flight.append(self._submit(next(self.stream)))
        request = self._in_flight.popleft()
        completions = self._collect(request)
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        with self._trainer_lock:
            version = self.trainer.version()
        staleness = check_staleness(completions, version, rl.off_policy_steps)
        ctx = SampleContext(
            step,
            self.row_len,
            self.row_multiple,
            self.tokenizer,
            lambda: self._score(self._submit(next(self.stream))),
        )
        data = self.method.from_samples(self.cfg, self._score(request), ctx)
        batch = data.batch
        reward_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        with self._trainer_lock:
            trained = self.trainer.train(batch) if batch is not None else None
        train_s = time.perf_counter() - t2
        # A trainer in this process compiles on this process's clock; an actor's reports its own.
        remote = trained is not None and self.trainer.remote
        self._trainer_compile = trained.compile if remote else CompileTally()  # type: ignore[union-attr]
        sync_s, sync_bytes = self._sync() if batch is not None else (0.0, 0)  # no update: the samplers hold these
        times = StepTimes(gen_s, reward_s, train_s, sync_s, sync_bytes, step_s=time.perf_counter() - t0)
        metrics = scored_metrics(data.scored, staleness)
        metrics.update(data.metrics)
        if trained is not None:
            metrics.update(trained.metrics)
        metrics.update(times.metrics(tokens=sum(len(c.token_ids) for c in data.scored.completions)))
        metrics.update(self.step_compile().metrics())
        metrics.update(
            {
                "policy_version": float(self.samplers.policy_versions[0]),
                "sampler_restarts": float(self.samplers.restarts),
                "sampler_redone_prompts": float(self.samplers.redone_prompts),
            }
        )
        if batch is not None:
            metrics.update({"pack/rows": float(batch.packed.rows), "pack/fill": batch.packed.fill()})
        method = " | ".join(part for part in (data.line, trained.line if trained else "") if part)
        self._last_line = step_line(step, metrics, method)
        self._last_metrics = metrics
        self.metrics.log(step, metrics, console=False)  # every step's metrics are kept

    def compile_elsewhere(self) -> CompileTally:
        return self._trainer_compile

    def compiled_elsewhere(self) -> CompileTally | None:
        return self.trainer.compiled() if self.trainer.remote else None

    def log(self, step: int) -> None:
        """The console line of the step (every `train.log_every` steps; metrics.jsonl holds every step)."""
        print(self._last_line, flush=True)

    def save(self, step: int) -> None:
        self.trainer.save(step, saved_position(step, self.stream, self._requests, self._in_flight, self._collect))
        self._saved = step

    def saved_step(self) -> int | None:
        return self._saved

    def export(self) -> Path | None:
        self._hf_dir = Path(self.trainer.export(str(self.run_dir / "hf"), self.tokenizer_dir))
        return self._hf_dir

    def summary(self, step: int) -> dict:
        return {"steps": step, "policy_version": self.trainer.version(), "final_eval": self.final_eval}

    def close_logs(self) -> None:
        self.metrics.close()

    # ------------------------------------------------------------- evaluation

    def evaluate(self, step: int | None = None) -> dict:
        """Greedy pass@1, sampled pass@k (unbiased) and maj@k on the held-out prompts, by `rl.accuracy_fn` (with a
        `step`: logged, and kept as the run's latest evaluation)."""
        rl = self.cfg.rl
        rows = self.eval_rows[: rl.eval_prompts]
        if not rows or rl.accuracy_fn is None:
            if step is not None:
                self.final_eval = {}
            return {}
        k = rl.eval_samples
        self._settle()  # the engines serve one set of episodes at a time
        greedy_params = self.sampling_params(1, 0, temperature=0.0)
        sampled_params = self.sampling_params(k, self.cfg.run.seed)
        if self.agent is not None:  # whole episodes, scored on their final answers
            greedy = self.agent.run(rows, greedy_params, self._turns(len(rows)))[0]
            sampled = self.agent.run(rows, sampled_params, self._turns(len(rows) * k))[0]
        else:
            prompts = [render_prompt(r, rl) for r in rows]
            greedy, sampled = self._generate(prompts, greedy_params), self._generate(prompts, sampled_params)
        result = held_out_metrics(rows, rl, greedy, sampled, self.rewards)
        if step is not None:
            self.metrics.log(step, result, console=False)
            print(
                f"eval @ step {step}: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in result.items()), flush=True
            )
            self.final_eval = result
        return result

    def close(self, timeout_s: float | None = None) -> None:
        """Release the reward workers, samplers, trainer and placement group. Each step is best effort (after a
        failure some are already gone) and what fails is said, not raised over the error that stopped the run;
        the Ray steps get `timeout_s` in all (30 s; 10 s once the trainer was found gone, when the cluster may be
        gone too), so a cluster that went away cannot keep the run from ending."""
        timeout_s = timeout_s if timeout_s is not None else (10.0 if self.trainer.lost else 30.0)
        if self._background is not None:  # before the pool and samplers it uses go
            self._background.close(timeout_s)
        self.rewards.close()
        release(workers_to_release(self.samplers, self.trainer, self.placement), timeout_s)


def run_to_end(run: OnPolicyRun) -> RunSummary:
    """Train `run` to `train.steps`, then release its workers, samplers, trainer and placement group."""
    try:
        return run.run()
    finally:
        run.close()
