"""The on-policy run: sample -> score -> the method's batch -> train -> sync weights, on Ray or in one process.

    summary = build_sampler_run(cfg, posttrain.grpo.GRPO).fit()     # python -m recipes.grpo CONFIG.yml
    summary = build_sampler_run(cfg, posttrain.dpo.online.ONLINE_DPO).fit()   # the same run, another method

An on-policy method trains in the one run every method trains in (`core.run.Run` over `core.train_loop.TrainLoop`:
its hooks, NaN policy, SIGTERM, checkpoints, metrics, export and end); what is its own is the batch source,
`posttrain.onpolicy.source.SamplerSource`: samplers (`rollout.group.SamplerGroup` of `rollout.sampler.Sampler`s),
reward functions (`rewards.runner.RewardRunner`; optional: a method may need none), the method's batch of scored
completions, the weight sync after each update and the held-out pass@k. This module builds it: the config and
tokenizer checks, the placement, the trainer (`posttrain.trainer.TrainerHandle`, hosting the method's
`core.method_learner.MethodLearner`), the source and the samplers. The method is a
`posttrain.onpolicy.method.SamplingMethod`: what it checks of the config (`check`), what it makes of each step's
scored completions (`from_samples` -> `StepData`, its batch any `core.batch.TrainBatch`), how long its packed rows
are (`row_length`), and what trains and how (its `core.method.Method` part, in the trainer).

Modes (`rollout.sampler`, [grpo.md](../../docs/grpo.md)): `vllm`, the trainer and the samplers Ray actors in one
placement group, weights streamed after every update; `jax`, single controller, trainer and sampler in this process
on disjoint sub-meshes. Sync (`rl.off_policy_steps = 0`) trains on the current policy's completions; async (`d > 0`,
vLLM) keeps d batches in flight, each at most d policy versions old (checked every step).

Every step's metrics are logged (reward mean/std, total and per function, accuracy, completion length, truncation
rate, the method's metrics: clip fraction, KL, entropy, the sampler/trainer mismatch, staleness, a time breakdown);
`train.eval_every` evaluates on the held-out prompts; `checkpoint.every_steps`, the last step and SIGTERM checkpoint
(policy, optimizer, step, policy version, prompt-stream position, sampling-seed counter and, in async mode, the
completions still in flight), from which the run resumes exactly where an uninterrupted one would be. The tokenizer
is the offline methods' (`core.tokenizer.run_tokenizer`: `data.tokenizer_dir`, the initial checkpoint's, else one
trained on the prompt rows), checked before Ray or an engine starts.

Failures (the table in docs/grpo.md): a failed reward item drops its group, a failed sampler is restarted and its
share redone once, a dead trainer stops the run (`TrainerUnavailable`), a non-finite loss follows
`train.nan_policy`; each a message, not a traceback, from the recipe.
"""

from __future__ import annotations

from pathlib import Path

from core.chat_template import turn_stop_ids
from core.compile_cache import use_compile_cache
from core.config import ModelConfig
from core.data import load_tokenizer
from core.goodput import RunStart
from core.run import Run
from core.tokenizer import check_vocab, run_tokenizer
from core.train_loop import TrainLoop
from posttrain.config import PostTrainConfig
from posttrain.onpolicy.agent import AgentRollouts
from posttrain.onpolicy.checks import check_config, check_policy, check_tokenizer_template
from posttrain.onpolicy.method import SamplingMethod
from posttrain.onpolicy.program import ProgramRollouts
from posttrain.onpolicy.prompts import PromptStream, prompt_rows
from posttrain.onpolicy.rollouts import Rollouts, SingleTurn
from posttrain.onpolicy.source import SamplerSource
from posttrain.onpolicy.workers import release, workers_to_release
from posttrain.trainer import TrainerHandle, start_trainer
from rewards.runner import RewardRunner
from rollout.placement import Placement, reserve


def build_sampler_run(cfg: PostTrainConfig, method: SamplingMethod) -> Run:
    """Everything an on-policy `method` trains with, ready to `fit` (module docstring): checked, then the
    placement, trainer, source (restored from the latest checkpoint) and samplers; what started is released if a
    later part fails."""
    started = RunStart.now()
    use_compile_cache(cfg.compile.cache_dir)  # the JAX sampler's, in this process (the trainer's: its own)
    check_config(cfg)
    method.check(cfg)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rl = cfg.rl
    train_rows, eval_rows = prompt_rows(cfg)
    tokenizer_dir = run_tokenizer(cfg, lambda: method.tokenizer_texts(train_rows))
    check_tokenizer_template(tokenizer_dir, rl.use_chat_template)
    tokenizer = load_tokenizer(tokenizer_dir)  # read once: the checks, the stops, the method's batches
    method.check_tokenizer(cfg, tokenizer)
    # Chat prompts and episodes: a completion (a turn) ends on the template's end of turn, not only on EOS.
    turn_stops = turn_stop_ids(tokenizer) if rl.use_chat_template or rl.agent is not None else ()
    stream = PromptStream(train_rows, rl.batch.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    rewards = RewardRunner(cfg.reward)
    source: SamplerSource | None = None
    placement: Placement | None = None
    trainer: TrainerHandle | None = None
    loop: TrainLoop | None = None

    def release_all(timeout_s: float | None = None) -> None:
        """Release the reward workers, samplers, trainer and placement group. Each step is best effort (after a
        failure some are already gone) and what fails is said, not raised over the error that stopped the run;
        the Ray steps get `timeout_s` in all (30 s; 10 s once the trainer was found gone, when the cluster may be
        gone too), so a cluster that went away cannot keep the run from ending."""
        lost = trainer is not None and trainer.lost
        timeout_s = timeout_s if timeout_s is not None else (10.0 if lost else 30.0)
        if source is not None:  # its episodes in the background first: they use the pool and samplers
            source.close(timeout_s)
        rewards.close()
        if trainer is not None:
            samplers = source.samplers if source is not None else None
            release(workers_to_release(samplers, trainer, placement), timeout_s)
        elif placement is not None:
            placement.remove()

    try:
        # Multi-turn rollouts: the environment, tool parser and template are checked here, before Ray starts.
        rollouts: Rollouts = SingleTurn(rl)
        if rl.agent is not None and rl.agent.runs_agents:
            rollouts = ProgramRollouts(
                cfg, tokenizer_dir, rewards.pool, bool(rewards.functions), method.trains_segments
            )
        elif rl.agent is not None:
            rollouts = AgentRollouts(cfg, tokenizer_dir, rewards.pool)
        if cfg.rollout.sampler == "vllm":
            from rollout.ray import ensure_ray

            ensure_ray()
            placement = reserve(cfg)
        trainer = start_trainer(cfg, run_dir, method, placement)
        cfg = cfg.model_copy(update={"model": ModelConfig.model_validate(trainer.model_config())})  # the trainer's
        check_vocab(cfg.model.vocab_size, tokenizer_dir)
        check_policy(cfg, cfg.model)
        row_len, row_multiple = method.row_length(cfg), trainer.batch_shards()  # the trainer's data-parallel size
        source = SamplerSource(
            cfg, method, trainer, rewards, rollouts, stream, tokenizer, turn_stops, row_len, row_multiple, eval_rows
        )
        loop = TrainLoop(cfg, trainer, source, tokenizer_dir=tokenizer_dir, started=started)  # restores the source
        source.start(placement, run_dir / "rollout_init_hf", tokenizer_dir)  # on the restored weights
    except BaseException:
        if loop is not None:
            loop.logger.close()
        release_all()
        raise
    return Run(cfg, loop, tokenizer_dir, release=release_all)
