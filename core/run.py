"""One builder for every dataset method: mesh, tokenizer, model, trainer, source, loop, evaluation, export.

    run = build_run(cfg, method)        # core.pretrain.PRETRAINING, posttrain.sft.SFT, posttrain.dpo.offline.DPO,
                                        # posttrain.distill.method.DISTILL
    run.fit()

A method is a `core.method.Method` (the one contract every method writes): its loss, module tree and trainable
filter, what it checks, and here its parts given the built run (`parts(RunContext) -> MethodParts`: the training
pipeline, the held-out evaluation, `prepare` (what the loss reads of a pipeline item, from data the run holds) and
hooks of its own), and the batch compile-only compiles its update for (`example_batch`). Everything else is here,
once: the mesh from `mesh.*`; the rows of `data.source`; the tokenizer (`core.tokenizer.run_tokenizer`); the model from
`checkpoint.init_from` (its shape wins over `model.*`; adapters added with `model.lora`) or a random init; the
vocabulary check; the method's trainer (`core.method_learner.MethodLearner`, as an on-policy run's: its learner,
attached values, updates, NaN policy and export); its pipeline as a `core.batch_source.DatasetSource`; the
`core.train_loop.TrainLoop` with its checkpoints, exact resume and metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh

from core.batch_source import DatasetSource, Prepare, as_is
from core.compile_cache import use_compile_cache
from core.config import Config, resolve_mesh_shape
from core.config_loader import ConfigError
from core.data import DataBatch
from core.goodput import RunStart
from core.learner import Learner
from core.loop import Hook
from core.method import Method
from core.method_learner import MethodLearner
from core.train import TrainState
from core.train_loop import Evaluation, TrainLoop


@dataclass
class RunContext:
    """What a method builds its parts from."""

    cfg: Any  # the job's config (its schema's type), with the model section the initial checkpoint decided
    mesh: Mesh
    records: Sequence[dict]  # the rows of data.source
    tokenizer_dir: str
    tokenizer: Any
    learner: Learner


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
    closers: list[Callable[[], None]] = field(default_factory=list)  # what it started, stopped when the run ends


@dataclass
class Run:
    cfg: Any  # with the model section the initial checkpoint decided
    loop: TrainLoop
    tokenizer_dir: str
    parts: MethodParts

    def fit(self) -> TrainState:
        """Train to `train.steps` (resuming from `run.run_dir`); then stop what the method started (its
        `closers`: an actor it started), however the loop ended."""
        try:
            self.loop.fit()
            return self.loop.state
        finally:
            for close in self.parts.closers:
                close()


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


def build_run(cfg: Config, method: Method) -> Run:
    """Everything `method` trains with, ready to `fit`."""
    from core.checkpoint_models import initial_model
    from core.data import load_tokenizer
    from core.mesh import make_mesh
    from core.metrics import device_memory
    from core.models.summary import parameter_summary
    from core.sources import load_records
    from core.tokenizer import check_vocab, run_tokenizer

    started = RunStart.now()
    use_compile_cache(cfg.compile.cache_dir)
    method.check(cfg)
    try:  # fail early, with the sizes, on a bad mesh
        resolve_mesh_shape(cfg.mesh, jax.device_count())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mesh = make_mesh(cfg.mesh)
    records = load_records(cfg.data)
    tokenizer_dir = run_tokenizer(cfg, lambda: method.tokenizer_texts(records))
    tokenizer = load_tokenizer(tokenizer_dir)
    method.check_tokenizer(cfg, tokenizer)
    model, cfg = initial_model(cfg, mesh)
    if cfg.checkpoint.init_from is not None:
        print(f"initialised from {cfg.checkpoint.init_from}")
    check_vocab(cfg.model.vocab_size, tokenizer_dir)
    if cfg.mesh.debug_sharding:
        print(parameter_summary(model))
    trainer = MethodLearner(cfg, method, model, mesh)
    parts = method.parts(RunContext(cfg, mesh, records, tokenizer_dir, tokenizer, trainer.learner))
    if parts.skipped:
        print(f"skipped {len(parts.skipped)} malformed rows; first: {parts.skipped[0]}")
    for note in parts.notes:
        print(note)
    print(device_memory() + f" (after model init: {method.name})")
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
    return Run(cfg, loop, tokenizer_dir, parts)
