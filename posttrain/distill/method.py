"""Offline and online distillation as a method of the one skeleton (`core.method.Method`, built by `build_run`).

    run = build_run(cfg, DISTILL)       # python -m recipes.distill CONFIG.yml distill.regime=offline|online
    run.fit()

The rows are SFT's (chat or prompt / completion, `posttrain.sft.row_format`: the targets are the assistant turns'
or the completion's tokens); the student is the run's model (`checkpoint.init_from`, or `model.*`). What differs
between the two regimes is where the teacher's distribution comes from:

- offline: a dump (`distill.logits_dir`, written once by `python -m recipes.distill_logits`), opened and checked
  against this run's rows at start (`posttrain.distill.topk_store`); `prepare` gathers each batch's [B, C, k]
  ids and log-probs from it. The teacher is never loaded.
- online: the teacher (`distill.teacher`, any checkpoint with its own shape and the same tokenizer) is frozen
  state of the method's module tree (`posttrain.distill.objective.DistillModules`, outside the trainable filter):
  it runs on every micro-batch beside the student,
  over the whole vocabulary (`distill.top_k=0`) or its top-k; with feature pairs its layers' states too. With
  `distill.teacher_placement=actor` it runs in a Ray actor of its own instead
  (`posttrain.distill.remote_teacher`), and `attach` asks it for each batch's top-k: the offline objective on a
  live dump.

Both train `posttrain.distill.objective` with alpha and T on their schedules (`distill.*_schedule`), evaluate it
on the held-out split (`eval/kl`: forward KL at T = 1, the run-comparable figure; `eval/perplexity` of the
student on the targets) and log SFT's greedy generations (`sft.eval_generations`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from core.batch_source import Evaluation
from core.config_loader import ConfigError
from core.data import DataBatch, tokenize_examples
from core.learner import Learner
from core.method import Attach, Method, Served
from core.models.lora import trainable_filter
from core.pretrain import next_token_parts
from core.run import MethodParts, RunContext, check_rows
from core.train import LossFn
from core.trainer import Trainer
from posttrain.config import PostTrainConfig
from posttrain.distill.features import FeatureProjections, feature_projections
from posttrain.distill.objective import (
    DistillBatch,
    DistillModules,
    DistillSettings,
    distill_objective,
    schedules,
    trainable,
)
from posttrain.distill.teacher import check_teacher_tokenizer, load_teacher
from posttrain.sft import SFT, generation_hooks, row_format


def dump_temperature(cfg: PostTrainConfig) -> float:
    """The temperature the offline dump's log-probs were taken at (its index's; the config's before it exists)."""
    from posttrain.distill.topk_store import read_index

    index = read_index(cfg.distill.logits_dir) if cfg.distill.logits_dir else None
    return float(index["header"]["temperature"]) if index else cfg.distill.dump_temperature


def dump_dtype(cfg: PostTrainConfig) -> str:
    """The dtype of the offline dump's log-probs (its index's; the config's before it exists)."""
    from posttrain.distill.topk_store import read_index

    index = read_index(cfg.distill.logits_dir) if cfg.distill.logits_dir else None
    return str(index["header"]["dtype"]) if index else cfg.distill.dump_dtype


def check_top_k(k: int, key: str, tokenizer) -> None:
    """A top-k no larger than the vocabulary it is taken over (the tokenizer's), checked before any work."""
    if k > len(tokenizer):
        raise ConfigError(f"{key}={k} is above the vocabulary the top-k is taken over ({len(tokenizer)} tokens)")


def teacher_in_step(cfg: PostTrainConfig) -> bool:
    """Online with the teacher beside the student (in the train step), not in an actor of its own."""
    return cfg.distill.regime == "online" and cfg.distill.teacher_placement == "beside"


def stored_temperature(cfg: PostTrainConfig) -> float:
    """The temperature of the top-k log-probs the batch brings: the dump's (offline), 1 (a teacher actor's)."""
    return dump_temperature(cfg) if cfg.distill.regime == "offline" else 1.0


def settings(cfg: PostTrainConfig) -> DistillSettings:
    d = cfg.distill
    t_start, t_end, t_kind = d.at("temperature")
    return DistillSettings(
        kind=d.loss,
        beta=d.beta,
        top_k=d.top_k if teacher_in_step(cfg) else 0,
        mode=d.top_k_mode,
        t2_scaling=d.t2_scaling,
        dump_temperature=d.dump_temperature if teacher_in_step(cfg) else stored_temperature(cfg),
        unit_temperature=t_start == 1.0 and (t_kind == "constant" or t_end == 1.0),
        feature_layers=tuple((s, t) for s, t in d.feature_layers),
        feature_kind=d.feature_loss,
    )


def check_config(cfg: PostTrainConfig) -> None:
    d = cfg.distill
    check_rows(
        cfg,
        "distillation",
        {"chat": "a `messages` list", "prompt_completion": "`prompt`, `completion`"},
        "; the teacher distils into the student on SFT's rows",
    )
    if d.regime == "on_policy":
        raise ConfigError("distill.regime=on_policy samples from the student: run it with python -m recipes.distill")
    if d.teacher_placement == "actor" and cfg.placement.trainer_processes > 1:
        raise ConfigError(
            f"distill.teacher_placement=actor with placement.trainer_processes={cfg.placement.trainer_processes}: "
            "the teacher's own Ray actor serves one trainer process; in a process group the teacher runs beside the "
            "student in the step (distill.teacher_placement=beside), sharded over the group's devices"
        )
    if d.regime == "offline" and (d.logits_dir is None or not (Path(d.logits_dir) / "index.json").exists()):
        where = "distill.logits_dir" if d.logits_dir is None else f"distill.logits_dir={d.logits_dir} (no index.json)"
        raise ConfigError(
            f"distill.regime=offline reads the teacher's top-k from {where}: write it once with "
            f"python -m recipes.distill_logits (the same config)"
        )
    if d.regime == "online" and d.teacher is None:
        raise ConfigError("distill.regime=online needs distill.teacher (an HF directory, a Hub id or a Temper run)")
    stored_dtype = dump_dtype(cfg)
    if d.regime == "offline" and d.top_k_mode == "tail" and stored_dtype != "float32":
        raise ConfigError(
            f"distill.top_k_mode=tail with the {stored_dtype} dump in {d.logits_dir}: the teacher's tail bucket is 1 "
            f"minus its top-k probabilities, which a {stored_dtype} log-prob cannot resolve (bfloat16 keeps 8 bits "
            f"of mantissa: the bucket comes out 0 or off by ~1e-2); use distill.top_k_mode=renormalised, or dump in "
            f"float32 (distill.dump_dtype=float32)"
        )
    t_start, t_end, _ = d.at("temperature")
    stored = stored_temperature(cfg)
    if d.top_k_mode == "tail" and not teacher_in_step(cfg) and not t_start == t_end == stored:
        source = "the dump's" if d.regime == "offline" else "the teacher actor's"
        raise ConfigError(
            f"distill.top_k_mode=tail reads {source} log-probs as they are: they were taken at T={stored}, so "
            f"distill.temperature must be that, constant (renormalised top-k reads them at any temperature)"
        )


def feature_projections_for(cfg: PostTrainConfig, mesh, teacher) -> FeatureProjections | None:
    """With `distill.feature_layers`: the learned projections from the student's width to the teacher's (None
    when they agree), replicated on the mesh; the layer numbers are checked against both models here."""
    pairs = cfg.distill.feature_layers
    if not pairs:
        return None
    for i, (s_layer, t_layer) in enumerate(pairs):
        for who, layer, n in (
            ("student", s_layer, cfg.model.num_layers),
            ("teacher", t_layer, teacher.cfg.num_layers),
        ):
            if not 1 <= layer <= n:
                raise ConfigError(
                    f"distill.feature_layers[{i}] = {[s_layer, t_layer]}: the {who} has layers 1..{n}, not {layer}"
                )
    projections = feature_projections(pairs, cfg.model.hidden_size, teacher.cfg.hidden_size, cfg.run.seed)
    if projections is not None:
        replicated = NamedSharding(mesh, PartitionSpec())
        nnx.update(projections, jax.device_put(nnx.state(projections), replicated))
    return projections


class Distillation(Method):
    name = "distillation"

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]:
        return SFT.tokenizer_texts(records)

    def loss(self, cfg: PostTrainConfig) -> LossFn:
        return distill_objective(settings(cfg), cfg.model)

    def modules(self, cfg: PostTrainConfig, model, mesh) -> DistillModules:
        """The student; online beside it, the teacher read with its own shape onto the run's mesh (offline reads
        a dump, a teacher actor answers each batch) and, with `distill.feature_layers`, the projections from the
        student's width to the teacher's."""
        teacher = None
        if teacher_in_step(cfg):
            teacher = load_teacher(cfg, mesh, cfg.model.vocab_size, str(cfg.checkpoint.init_from or "a random init"))
        return DistillModules(model, feature_projections_for(cfg, mesh, teacher), teacher)

    def trainable(self, cfg: PostTrainConfig):
        return trainable(trainable_filter(cfg.model))

    def attach(self, cfg: PostTrainConfig, learner: Learner) -> Attach[DistillBatch]:
        """The scheduled values (alpha, temperature, the feature weight) at the update the batch trains at; with
        the teacher in a Ray actor of its own (`distill.teacher_placement=actor`), its top-k at every target slot,
        asked of the actor this starts (and the trainer stops at the end: `core.method.Served`)."""
        remote = None
        if cfg.distill.regime == "online" and not teacher_in_step(cfg):
            from posttrain.distill.remote_teacher import RemoteTeacher

            student = str(cfg.checkpoint.init_from or "a random init")
            remote = RemoteTeacher.start(cfg, cfg.model.vocab_size, student)
            print(f"teacher: {cfg.distill.teacher} in a Ray actor ({remote.where}), its top-{cfg.distill.top_k}")

        def attach(batch: DistillBatch) -> tuple[DistillBatch, dict[str, float]]:
            rows = np.asarray(batch.packed.target_ids).shape[0]
            batch = batch.replace(**schedules(cfg.distill, int(learner.state.step), cfg.train.steps, rows))
            if remote is not None:  # as the learner splits the batch: into its packing groups
                ids, logp = remote.score(batch.packed, batch.packed.groups)
                batch = batch.replace(teacher_ids=ids, teacher_logp=logp)
            return batch, {}

        return attach if remote is None else Served(attach, remote.close)

    def check_tokenizer(self, cfg: PostTrainConfig, tokenizer) -> None:
        """The top-k fits the vocabulary; an online teacher's own tokenizer is the run's (before a teacher is
        loaded or its actor started)."""
        check_top_k(cfg.distill.top_k, "distill.top_k", tokenizer)
        if cfg.distill.regime == "online":
            check_teacher_tokenizer(str(cfg.distill.teacher), tokenizer)

    def parts(self, run: RunContext) -> MethodParts:
        cfg = run.cfg
        rows = row_format(cfg.data.format, cfg.sft.completion_only_loss)
        examples = tokenize_examples(run.records, rows, run.tokenizer, cfg.data)
        notes = []
        store = None
        if cfg.distill.regime == "offline":
            from posttrain.distill.dump import data_settings
            from posttrain.distill.topk_store import TopKStore

            data = data_settings(cfg, run.tokenizer)
            store = TopKStore.open(cfg.distill.logits_dir, data, cfg.model.vocab_size, examples)
            notes.append(
                f"teacher: top-{store.header.k} of {store.header.teacher or 'a teacher'} from "
                f"{cfg.distill.logits_dir} (T={store.header.temperature}, {store.header.dtype})"
            )
        if cfg.distill.regime == "online" and not teacher_in_step(cfg):
            notes.append(f"teacher: {cfg.distill.teacher} in a Ray actor of its own (attached to each batch)")
        elif cfg.distill.regime == "online":
            notes.append(f"teacher: {cfg.distill.teacher} in the step ({_support(cfg)})")
            if cfg.distill.feature_layers:
                learned = run.trainer.apply(_has_projections)
                how = "through learned projections" if learned else "as they are"
                notes.append(
                    f"feature loss ({cfg.distill.feature_loss}) on layers {cfg.distill.feature_layers} "
                    f"(student, teacher), {how}"
                )
        base = next_token_parts(run, rows, hooks=lambda ex: generation_hooks(run, ex), examples=examples)

        def prepare(data: DataBatch, groups: int) -> DistillBatch:
            """The teacher's top-k from the dump (data the run holds); the schedules' values at the trainer's step
            and a teacher actor's answers are `attach`'s."""
            packed = data.batch
            batch = DistillBatch(packed)
            if store is None:
                return batch
            ids, logp = store.gather(data.example_ids, np.asarray(packed.positions), _token_at(packed, groups))
            return batch.replace(teacher_ids=ids, teacher_logp=logp)

        evaluation = None
        if base.evaluation is not None:
            evaluation = Evaluation(base.evaluation.batches, derive=_perplexity)
        return MethodParts(
            base.train,
            evaluation,
            prepare=prepare,
            hooks=base.hooks,
            skipped=base.skipped,
            notes=notes,
            console={"kl": "kl", "nll": "nll", **({"feature": "feat"} if cfg.distill.feature_layers else {})},
        )

    def example_batch(self, cfg: PostTrainConfig, row_multiple: int) -> Any:
        raise ConfigError(
            "train.compile_only: not for distillation: its step reads the teacher (its parameters or its dump), "
            "which compile-only does not load; compile the student's SFT step instead (python -m recipes.sft)"
        )


def _has_projections(trainer: Trainer) -> bool:
    """Whether the student's features reach the teacher's through learned projections (the widths differ)."""
    modules = trainer.learner.learner.modules()
    assert isinstance(modules, DistillModules)
    return modules.projections is not None


def _support(cfg: PostTrainConfig) -> str:
    k = cfg.distill.top_k
    return f"its top-{k}, {cfg.distill.top_k_mode}" if k else "the whole vocabulary"


def _perplexity(means: dict[str, float]) -> dict[str, float]:
    """The student's perplexity on the held-out targets (from its NLL, not the distillation loss)."""
    return {"perplexity": math.exp(min(means["nll"], 50.0))}


def _token_at(packed, groups: int) -> np.ndarray:
    """[B, C] the row position of the token each target slot predicts (-1: an empty slot): `target_index` is
    flat into its micro-batch's rows and points at the position before the token."""
    index = np.asarray(packed.target_index)
    b, length = index.shape[0], np.asarray(packed.tokens).shape[1]
    per_group = b // groups
    local = index - (np.arange(b) % per_group)[:, None] * length + 1
    return np.where(np.asarray(packed.target_mask) > 0, local, -1)


DISTILL = Distillation()
