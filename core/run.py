"""One builder for every offline method: mesh, tokenizer, model, learner, loop, evaluation, export.

    run = build_run(cfg, method)        # core.pretrain.PRETRAINING, posttrain.sft.SFT, posttrain.dpo.offline.DPO,
                                        # posttrain.distill.method.DISTILL
    run.fit()

A method (`Method`) says what is its own: the config it needs (`check`, before anything starts), the text a
tokenizer would be trained on when the run has none (`tokenizer_texts`), its loss (`loss`, the `core.train`
contract), a model its loss reads beside the trained one (`frozen_model`: online distillation's teacher), a module
trained beside the model (`companion`: feature distillation's projections), and,
given the built run (`RunContext`: config, mesh, rows, tokenizer, learner), its `MethodParts`:
the training pipeline, the held-out evaluation, `prepare` (frozen models' values attached to a batch) and any
hooks of its own. Everything else is here, once: the mesh from `mesh.*`; the rows of `data.source`; the tokenizer
(`data.tokenizer_dir`, else the initial checkpoint's, else one trained on the method's text into
`run_dir/tokenizer`); the model from `checkpoint.init_from` (its shape wins over `model.*`) or a random init; the
vocabulary check; the `core.learner.Learner` on the method's loss; the `core.loop.TrainLoop` with its
checkpoints, exact resume, NaN policy, metrics and Hugging Face export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from core.config import Config, resolve_mesh_shape
from core.config_loader import ConfigError
from core.data import DataBatch
from core.learner import Learner
from core.loop import Evaluation, Hook, Prepare, TrainLoop, _as_is
from core.train import LossFn, TrainState


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
    prepare: Prepare = _as_is  # (batch, packing groups) -> what the loss reads
    hooks: Sequence[Hook] = ()  # the method's own cadence (SFT's greedy generations)
    skipped: list[str] = field(default_factory=list)  # rows left out (data.skip_malformed), described
    notes: list[str] = field(default_factory=list)  # one line each at start-up (where a reference comes from)
    console: dict[str, str] = field(default_factory=dict)  # metric -> label: the method's own on the console line
    closers: list[Callable[[], None]] = field(default_factory=list)  # what it started, stopped when the run ends


class Method(Protocol):
    """An offline method (`core.pretrain.PRETRAINING`, `posttrain.sft.SFT`, `posttrain.dpo.offline.DPO`)."""

    @property
    def name(self) -> str:
        """What the run calls it ("SFT", "DPO")."""
        ...

    def check(self, cfg: Any) -> None:
        """Raise `ConfigError` for a config this method cannot run (before anything is loaded)."""
        ...

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]: ...

    def loss(self, cfg: Any) -> LossFn: ...

    def frozen_model(self, cfg: Any, mesh: Mesh) -> Any | None:
        """A model the loss reads in every step without training it (online distillation's teacher), or None."""
        ...

    def companion(self, cfg: Any, mesh: Mesh, frozen: Any | None) -> Any | None:
        """A module trained beside the model and kept apart from it (`core.learner.Learner(companion=...)`: a
        feature-distillation projection, given the frozen model), placed on `mesh`; or None."""
        ...

    def parts(self, run: RunContext) -> MethodParts: ...

    def example_batch(self, cfg: Any, row_multiple: int) -> Any:
        """A training batch of the configured shapes (full rows; a row count divisible by `row_multiple`, the
        data-parallel size) from the method's own batch builder: what `core.compile_only` compiles the update
        for."""
        ...


@dataclass
class Run:
    cfg: Any  # with the model section the initial checkpoint decided
    loop: TrainLoop
    tokenizer_dir: str
    parts: MethodParts

    def fit(self) -> TrainState:
        """Train to `train.steps` (resuming from `run.run_dir`); then stop what the method started (its
        `closers`: a teacher actor), however the loop ended."""
        try:
            return self.loop.fit()
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
    from core.checkpoint import initial_model
    from core.data import load_tokenizer
    from core.distributed import primary_first
    from core.mesh import make_mesh
    from core.metrics import device_memory
    from core.models.summary import parameter_summary
    from core.sources import load_records
    from core.tokenizer import check_vocab, tokenizer_for_run

    method.check(cfg)
    try:  # fail early, with the sizes, on a bad mesh
        resolve_mesh_shape(cfg.mesh, jax.device_count())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mesh = make_mesh(cfg.mesh)
    run_dir = Path(cfg.run.run_dir)
    records = load_records(cfg.data)
    tokenizer_dir = primary_first(  # in a process group one process trains a missing tokenizer, the rest read it
        lambda: tokenizer_for_run(
            cfg.data.tokenizer_dir,
            method.tokenizer_texts(records),
            run_dir,
            cfg.model.vocab_size,
            cfg.checkpoint.init_from,
        ),
        "the run's tokenizer",
    )
    model, cfg = initial_model(cfg, mesh)
    if cfg.checkpoint.init_from is not None:
        print(f"initialised from {cfg.checkpoint.init_from}")
    check_vocab(cfg.model.vocab_size, tokenizer_dir)
    if cfg.mesh.debug_sharding:
        print(parameter_summary(model))
    frozen = method.frozen_model(cfg, mesh)
    learner = Learner(
        model,
        mesh,
        method.loss(cfg),
        cfg.optim,
        total_updates=cfg.train.steps,
        seed=cfg.run.seed,
        frozen=frozen,
        companion=method.companion(cfg, mesh, frozen),
    )
    tokenizer = load_tokenizer(tokenizer_dir)
    parts = method.parts(RunContext(cfg, mesh, records, tokenizer_dir, tokenizer, learner))
    if parts.skipped:
        print(f"skipped {len(parts.skipped)} malformed rows; first: {parts.skipped[0]}")
    for note in parts.notes:
        print(note)
    print(device_memory() + f" (after model init: {method.name})")
    loop = TrainLoop(
        cfg,
        learner,
        parts.train,
        evaluation=parts.evaluation,
        tokenizer_dir=tokenizer_dir,
        prepare=parts.prepare,
        hooks=parts.hooks,
        console=parts.console,
    )
    return Run(cfg, loop, tokenizer_dir, parts)
