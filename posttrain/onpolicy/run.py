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

import time
from collections.abc import Sequence
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
from posttrain.onpolicy.checks import check_config, check_policy, check_tokenizer_template
from posttrain.onpolicy.evaluation import held_out_metrics
from posttrain.onpolicy.method import SamplingMethod
from posttrain.onpolicy.prompts import PromptStream, prompt_rows, render_prompt
from posttrain.onpolicy.source import SamplerSource
from posttrain.onpolicy.step import (
    StepTimes,
    scored_metrics,
    step_line,
)
from posttrain.onpolicy.workers import release, workers_to_release
from posttrain.trainer import start_trainer
from rewards.runner import RewardRunner
from rollout.group import SamplerGroup
from rollout.placement import Placement, reserve


class OnPolicyRun(Loop):
    """The samplers' batches (`posttrain.onpolicy.source.SamplerSource`), one step of the method's trainer each,
    evaluation and checkpoints, shared by every on-policy method (`posttrain.grpo.GRPO`,
    `posttrain.dpo.online.ONLINE_DPO`, ...): the method turns scored completions into its batch (`from_samples`) and
    says what trains and how (the trainer hosts it). The loop itself (hooks, NaN policy, SIGTERM, the end) is
    `core.loop.Loop`'s, as the dataset methods'."""

    cfg: PostTrainConfig

    def __init__(self, cfg: PostTrainConfig, method: SamplingMethod):
        started = RunStart.now()
        use_compile_cache(cfg.compile.cache_dir)  # the JAX sampler's, in this process (the trainer's: its own)
        self.source: SamplerSource | None = None
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
        turn_stops = turn_stop_ids(self.tokenizer) if chat else ()
        stream = PromptStream(self.train_rows, rl.batch.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
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
        self.source = SamplerSource(
            cfg, method, self.trainer, self.rewards, self.agent, stream, self.tokenizer, turn_stops,
            self.row_len, self.row_multiple,
        )  # fmt: skip
        start_step = 0
        restored = self.trainer.restore_latest()
        if restored is not None:
            step, meta = restored
            start_step = self.source.restore(meta)
            print(
                f"resumed from {run_dir / 'checkpoints' / str(step)} at step {start_step} "
                f"(policy version {meta['policy_version']})",
                flush=True,
            )
        self._saved = start_step if restored is not None else None
        # init_hf: the Hugging Face directory vLLM engines started from (None with the JAX sampler)
        self.init_hf = self.source.start(self.placement, run_dir / "rollout_init_hf", self.tokenizer_dir)
        super().__init__(cfg, run_dir, start_step, started=started)
        self._trainer_compile = CompileTally()  # the step's, in the trainer's own process (a Ray actor)
        self.metrics = MetricsLogger(run_dir, cfg.logging, cfg.train.steps, resume_step=start_step)
        self.final_eval: dict | None = None
        self._last_line = ""
        self._last_metrics: dict[str, float] = {}
        self._hf_dir: Path | None = None

    @property
    def samplers(self) -> SamplerGroup:
        assert self.source is not None and self.source.samplers is not None
        return self.source.samplers

    @property
    def plots(self) -> Sequence[Plot]:  # type: ignore[override]
        return self.method.plots(self.cfg)

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
        """One step: the source's batch (sample or collect what is in flight, score, the method's batch), the
        trainer's step, the weight sync."""
        assert self.source is not None
        t0 = time.perf_counter()
        sampled = self.source.next()
        data, batch = sampled.data, sampled.data.batch
        t2 = time.perf_counter()
        with self.source.lock:
            trained = self.trainer.train(batch, step) if batch is not None else None  # a NaN names `step`
        train_s = time.perf_counter() - t2
        # A trainer in this process compiles on this process's clock; an actor's reports its own.
        remote = trained is not None and self.trainer.remote
        self._trainer_compile = trained.compile if remote else CompileTally()  # type: ignore[union-attr]
        # No update: the samplers hold these weights already.
        sync_s, sync_bytes = self.source.after_update(self.trainer) if batch is not None else (0.0, 0)
        times = StepTimes(
            sampled.generate_s, sampled.reward_s, train_s, sync_s, sync_bytes, step_s=time.perf_counter() - t0
        )
        metrics = scored_metrics(data.scored, sampled.staleness)
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
        assert self.source is not None
        self.trainer.save(step, self.source.state)
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
        assert self.source is not None
        self.source.settle()  # the engines serve one set of episodes at a time
        greedy_params = self.source.sampling_params(1, 0, temperature=0.0)
        sampled_params = self.source.sampling_params(k, self.cfg.run.seed)
        if self.agent is not None:  # whole episodes, scored on their final answers
            greedy = self.agent.run(rows, greedy_params, self.source.turns(len(rows)))[0]
            sampled = self.agent.run(rows, sampled_params, self.source.turns(len(rows) * k))[0]
        else:
            prompts = [render_prompt(r, rl) for r in rows]
            greedy = self.source.generate(prompts, greedy_params)
            sampled = self.source.generate(prompts, sampled_params)
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
        samplers = None
        if self.source is not None:  # its episodes in the background first: they use the pool and samplers
            self.source.close(timeout_s)
            samplers = self.source.samplers
        self.rewards.close()
        release(workers_to_release(samplers, self.trainer, self.placement), timeout_s)


def run_to_end(run: OnPolicyRun) -> RunSummary:
    """Train `run` to `train.steps`, then release its workers, samplers, trainer and placement group."""
    try:
        return run.run()
    finally:
        run.close()
