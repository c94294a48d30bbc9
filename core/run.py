"""A built run, any method's (`Run`: train, fit, close), and the builder of a dataset method's run: rows, tokenizer,
trainer, source, loop, evaluation, export (the samplers' builder is `posttrain.onpolicy.run.build_sampler_run`).

    run = build_run(cfg, method)        # core.pretrain.PRETRAINING, posttrain.sft.SFT, posttrain.dpo.offline.DPO,
                                        # posttrain.distill.method.DISTILL
    run.fit()

A method is a `core.method.Method` (the one contract every method writes): its loss, module tree and trainable
filter, what it checks, and here its parts given the built run (`parts(RunContext) -> MethodParts`: the training
pipeline, the held-out evaluation, `prepare` (what the loss reads of a pipeline item, from data the run holds) and
hooks of its own), and the batch compile-only compiles its update for (`example_batch`). Everything else is here,
once: the rows of `data.source`; the tokenizer (`core.tokenizer.run_tokenizer`); the method's trainer
(`core.trainer.Trainer`: the mesh from `mesh.*`, the model from `checkpoint.init_from` (its shape wins over
`model.*`; adapters added with `model.lora`) or a random init, and the method's `core.method_learner.MethodLearner`,
as an on-policy run's), in this process or started elsewhere by the caller (`start_trainer`: a process group's
handle, `posttrain.offline`); the vocabulary check; its pipeline as a `core.batch_source.DatasetSource`; the
`core.train_loop.TrainLoop` with its checkpoints, exact resume and metrics. A method's work on the model from here
goes through `RunContext.trainer.apply`, so it runs wherever the trainer is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.batch_source import DatasetSource, Evaluation, Prepare, as_is
from core.compile_cache import use_compile_cache
from core.config import Config
from core.config_loader import ConfigError
from core.data import DataBatch
from core.goodput import RunStart
from core.loop import Hook
from core.method import Method
from core.train_loop import TrainLoop
from core.trainer import Trainer, TrainerCalls, initial_state

# (the run's config) -> its trainer, started elsewhere (a process group's handle)
StartTrainer = Callable[[Any], TrainerCalls]


@dataclass
class RunContext:
    """What a method builds its parts from."""

    cfg: Any  # the job's config (its schema's type), with the model section the initial checkpoint decided
    records: Sequence[dict]  # the rows of data.source
    tokenizer_dir: str
    tokenizer: Any
    # The trainer: in this process or a process group's (`core.trainer`); a method's work on the model (values
    # stored before the first step) goes through `trainer.apply`.
    trainer: TrainerCalls
    row_multiple: int  # the trainer's data-parallel size: packed row counts are made a multiple of it


@dataclass
class MethodParts:
    """What a method trains on and how: the loop runs them."""

    train: Iterable[DataBatch]  # training batches, forever; a Grain iterator (its position is checkpointed)
    evaluation: Evaluation | None = None  # the held-out split (None: no data.eval_fraction)
    # (batch, packing groups) -> what the loss reads, from data the run holds (stored values gathered by example
    # id); a frozen model's values are `Method.attach`'s
    prepare: Prepare = as_is
    hooks: Sequence[Hook] = ()  # the method's own cadence (SFT's greedy generations)
    skipped: list[str] = field(default_factory=list)  # rows left out (data.skip_malformed), described
    notes: list[str] = field(default_factory=list)  # one line each at start-up (where a reference comes from)
    console: dict[str, str] = field(default_factory=dict)  # metric -> label: the method's own on the console line


@dataclass
class RunSummary:
    """What a finished run reports: its directory, the steps taken, the policy version (updates applied), the last
    held-out evaluation at a step (None: none ran) and the Hugging Face export."""

    run_dir: Path
    steps: int
    policy_version: int
    final_eval: dict | None
    hf_dir: Path | None


class Run:
    """A built run, any method's: the loop (`core.train_loop.TrainLoop`) over its source and trainer, and what it
    releases at its end (`release`: the samplers, reward workers and placement of an on-policy run; default: the
    trainer, with what the method's attach serves from (`core.method.Served`) and its checkpoint writer)."""

    def __init__(
        self,
        cfg: Any,
        loop: TrainLoop,
        tokenizer_dir: str,
        parts: MethodParts | None = None,
        release: Callable[[], None] | None = None,
    ):
        self.cfg = cfg  # with the model section the trainer's initial checkpoint decided
        self.loop = loop
        self.tokenizer_dir = tokenizer_dir
        self.parts = parts
        self._release = release
        self._closed = False

    @property
    def trainer(self) -> TrainerCalls:
        return self.loop.trainer

    @property
    def source(self) -> Any:
        return self.loop.source

    @property
    def start_step(self) -> int:
        return self.loop.start_step

    def train(self, on_step: Callable[[Run, int, dict], None] | None = None) -> RunSummary:
        """Train to `train.steps` (resuming from `run.run_dir`); releases nothing. `on_step(run, step, metrics)` is
        called after every step (tests, notebooks)."""
        hooks = self.loop.hooks
        if on_step is not None:
            hooks.append(Hook("on_step", 1, lambda loop, step: on_step(self, step, loop.last_metrics)))
        try:
            step = self.loop.fit()
        finally:
            if on_step is not None:
                hooks.pop()
        return RunSummary(self.loop.run_dir, step, self.trainer.version(), self.loop.final_eval, self.loop.hf_dir)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """The source's held-out evaluation now; with a `step`, logged at it (before the run: 0)."""
        return self.loop.evaluate(step)

    def close(self) -> None:
        """Release what the run started, once, however it ended."""
        if self._closed:
            return
        self._closed = True
        self.loop.logger.close()  # a run stopped before `train` (an evaluation at step 0 failed) has it open
        if self._release is not None:
            self._release()
        elif not self.trainer.lost:  # a trainer group that is gone has nothing to stop
            self.trainer.close()

    def fit(self, on_step: Callable[[Run, int, dict], None] | None = None) -> RunSummary:
        """`train`, then `close`."""
        try:
            return self.train(on_step)
        finally:
            self.close()


def check_rows(cfg: Config, method: str, formats: dict[str, str], otherwise: str = "") -> None:
    """The checks every offline method makes of its data: `data.source` is set, and `data.format` is one it reads
    (`formats`: format -> what its rows hold; `otherwise`: where the other formats go)."""
    if cfg.data.format not in formats:
        reads = " or ".join(f"data.format={f} ({what})" for f, what in formats.items())
        raise ConfigError(f"{method} reads {reads}, not {cfg.data.format!r}{otherwise}")
    if cfg.data.source is None:
        raise ConfigError(
            f"{method} needs data.source (a local jsonl / parquet / arrow file, a directory or a Hugging Face Hub id)"
        )


def build_run(cfg: Config, method: Method, start_trainer: StartTrainer | None = None) -> Run:
    """Everything `method` trains with, ready to `fit`. `start_trainer(cfg)`: the trainer elsewhere (a process
    group's handle, `posttrain.offline`); default: a `core.trainer.Trainer` in this process."""
    from core.data import load_tokenizer
    from core.sources import load_records
    from core.tokenizer import check_vocab, run_tokenizer

    started = RunStart.now()
    use_compile_cache(cfg.compile.cache_dir)
    method.check(cfg)
    records = load_records(cfg.data)
    tokenizer_dir = run_tokenizer(cfg, lambda: method.tokenizer_texts(records))
    tokenizer = load_tokenizer(tokenizer_dir)
    method.check_tokenizer(cfg, tokenizer)
    trainer = local_trainer(cfg, method, tokenizer_dir) if start_trainer is None else start_trainer(cfg)
    try:
        facts = trainer.facts()
        cfg = cfg.model_copy(update={"model": type(cfg.model).model_validate(facts.model)})  # the checkpoint's shape
        if cfg.checkpoint.init_from is not None:
            print(f"initialised from {cfg.checkpoint.init_from}")
        if start_trainer is not None:  # a trainer here checked it before its method's frozen models loaded
            check_vocab(cfg.model.vocab_size, tokenizer_dir)
        parts = method.parts(RunContext(cfg, records, tokenizer_dir, tokenizer, trainer, facts.batch_shards))
        if parts.skipped:
            print(f"skipped {len(parts.skipped)} malformed rows; first: {parts.skipped[0]}")
        for note in parts.notes:
            print(note)
        print(trainer.device_memory() + f" (after model init: {method.name})")
        source = DatasetSource(parts.train, parts.prepare, cfg.train.micro_batches, parts.evaluation, parts.console)
        loop = TrainLoop(cfg, trainer, source, tokenizer_dir=tokenizer_dir, hooks=parts.hooks, started=started)
    except BaseException:  # what the trainer started (what an attach serves from, the checkpoint writer) goes too
        if not trainer.lost:
            trainer.close()
        raise
    return Run(cfg, loop, tokenizer_dir, parts)


def local_trainer(cfg: Config, method: Method, tokenizer_dir: str) -> Trainer:
    """The method's trainer in this process, on a mesh of its devices, from `checkpoint.init_from` or a random
    init (its vocabulary checked against the tokenizer's before the method's frozen models load)."""
    from core.tokenizer import check_vocab

    mesh, model, cfg = initial_state(cfg)
    check_vocab(cfg.model.vocab_size, tokenizer_dir)
    return Trainer(cfg, method, model, mesh, cfg.run.run_dir)
