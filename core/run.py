"""One builder for every dataset method: rows, tokenizer, trainer, source, loop, evaluation, export.

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
from typing import Any

from core.batch_source import DatasetSource, Prepare, as_is
from core.compile_cache import use_compile_cache
from core.config import Config
from core.config_loader import ConfigError
from core.data import DataBatch
from core.goodput import RunStart
from core.loop import Hook
from core.method import Method
from core.train_loop import Evaluation, TrainLoop
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
class Run:
    cfg: Any  # with the model section the initial checkpoint decided
    loop: TrainLoop
    tokenizer_dir: str
    parts: MethodParts

    def fit(self) -> int:
        """Train to `train.steps` (resuming from `run.run_dir`); the last step trained. Then stop what the method's
        attach serves from (`core.method.Served`) and the trainer's checkpoint writer, however the loop ended."""
        try:
            return self.loop.fit()
        finally:
            if not self.loop.trainer.lost:  # a trainer group that is gone has nothing to stop
                self.loop.trainer.close()


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
        loop = TrainLoop(
            cfg,
            trainer,
            DatasetSource(parts.train, parts.prepare, cfg.train.micro_batches),
            evaluation=parts.evaluation,
            tokenizer_dir=tokenizer_dir,
            hooks=parts.hooks,
            console=parts.console,
            started=started,
        )
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
