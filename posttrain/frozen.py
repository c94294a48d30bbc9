"""Models that do not train beside the one that does: a reference (GRPO's KL, DPO) or a teacher (distillation).

    reference = FrozenModel.start_of(learner)           # where the learner started (its base, with adapters off)
    teacher = FrozenModel.load("Qwen/Qwen2.5-1.5B-Instruct", mesh, "teacher")    # any checkpoint, its own shape
    logp = reference.logprobs(batch)                    # [B, C] float32 on the host, one packing group at a time
    logp = grouped_logprobs(LogprobPass(1.0), model, batch, mesh)   # the same, any model

A frozen model is either the learner's starting point (a reference: a copy of its starting parameters; for a
model with LoRA adapters the same model with its adapters off, TRL's reference for a PEFT model, which shares the
base's arrays and costs no second copy) or read from any checkpoint with the shape it was saved with (an HF
directory, a Hub id, a Temper run: `core.checkpoint_models.load_model_from`; a teacher larger or smaller than the
learner, `cfg` its model config). Log-probs are computed live, per batch, by one jitted pass over the packed
batch's targets (`core.targets.target_logprobs`), a packing group (one micro-batch's rows) at a time so that
memory stays that of one micro-batch; `posttrain.token_store` keeps values computed once instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from core.batch import CompiledCounts, PackedBatch
from core.config import ModelConfig
from core.distributed import CompiledTogether, to_host
from core.learner import Learner
from core.mesh import row_shards
from core.models import Decoder
from core.models.adapters import adapters_off
from core.packing import round_rows
from core.shape_plan import Need, Shape, apply
from core.shapes import SizeCache
from core.targets import states_logprobs, target_logprobs, target_states
from core.train import place_batch, split_micro_batches


def _logprobs(graphdef, state, batch: PackedBatch, temperature: float, vocab: int | None, routed: bool) -> jax.Array:
    model = nnx.merge(graphdef, state)
    if vocab is None:
        return target_logprobs(model, batch, temperature, entropy=False, routed=routed)[0]
    states = target_states(model, batch, routed=routed).over_vocab(vocab)
    return states.to_slots(states_logprobs(model.cfg, states, temperature)[0])


class LogprobPass:
    """`(model, packed group) -> [B_g, C]` log-probs of the targets, jitted (normalised over the first `vocab`
    tokens: a teacher's padded embedding read over its student's vocabulary; None: all its rows), with the
    batches' static counts it was compiled for (`counts`: a batch that fits one is padded into it, as a learner's
    update is). `routed`: the pass runs the model whose sampler routed the batch (the policy's own pi_old pass), so
    it reads the batch's routes as the policy's update does (with `PackedBatch.replay`, in place of its routers'
    choice); a frozen model's pass (a reference, a teacher) ignores them."""

    def __init__(self, temperature: float, vocab: int | None = None, routed: bool = False):
        self.temperature, self.vocab, self.routed = temperature, vocab, routed
        self._jitted = CompiledTogether(jax.jit(_logprobs, static_argnums=(0, 3, 4, 5)), "a log-prob pass")
        self.counts = CompiledCounts()
        self.rows = SizeCache(round_rows)  # rows a packing group, reused when a batch fits a count compiled before

    def __call__(self, model: Decoder, batch: PackedBatch) -> jax.Array:
        graphdef, state = nnx.split(model)
        return self._jitted(graphdef, state, batch, self.temperature, self.vocab, self.routed)


def grouped_logprobs(fn: LogprobPass, model: Decoder, batch: PackedBatch, mesh: Mesh) -> np.ndarray:
    """[B, C] float32 host log-probs of every target, computed one packing group at a time (`batch.groups`). A
    group's rows are padded with empty ones to a row count the pass has run (the rows an RL batch packs into vary
    from step to step; the targets, and so the result, do not move)."""
    need = Need(batch, dict(mesh.shape))
    if need.rows_vary:
        multiple = row_shards(need.rows, dict(mesh.shape))
        rows = round_rows(fn.rows.pick(need.rows), multiple)
        batch = apply(batch, Shape(rows, need.scored_slots, need.positions(rows)), need)
    placed = place_batch(split_micro_batches(batch, batch.groups, mesh, fn.counts), mesh)
    out = []
    with jax.set_mesh(mesh):
        for i in range(batch.groups):
            part = jax.tree.map(lambda x, i=i: x[i], placed)
            out.append(to_host(fn(model, part)))  # a collective in a process group
    return np.concatenate(out).astype(np.float32)


def copied(model: Decoder, mesh: Mesh) -> Decoder:
    """`model` with its own copy of every array, on `mesh` (what a learner donates stays the learner's)."""
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


@dataclass
class FrozenModel:
    """A model whose parameters never change, on the trainer mesh, and its jitted log-prob pass."""

    name: str  # "reference", "teacher": what the method calls it
    model: Decoder
    mesh: Mesh
    _pass: LogprobPass
    cfg: ModelConfig | None = None  # its shape (vocabulary, layers, width)

    @classmethod
    def copy_of(cls, model: Decoder, mesh: Mesh, name: str, temperature: float = 1.0) -> FrozenModel:
        """A frozen copy of `model`'s parameters (a learner's next update donates its own buffers)."""
        return cls(name, copied(model, mesh), mesh, LogprobPass(temperature), model.cfg)

    @classmethod
    def start_of(cls, learner: Learner, name: str = "reference", temperature: float = 1.0) -> FrozenModel:
        """Where the learner started, frozen: the reference every method that has one uses. A full model is copied
        as it is now (before its first update); a model with LoRA adapters is read with its adapters off (its base:
        TRL's reference for a PEFT model), sharing the base's frozen arrays."""
        model = learner.model()
        if model.cfg.lora is not None:
            return cls(name, adapters_off(model), learner.mesh, LogprobPass(temperature), model.cfg)
        return cls.copy_of(model, learner.mesh, name, temperature)

    @classmethod
    def load(
        cls,
        path: str,
        mesh: Mesh,
        name: str,
        temperature: float = 1.0,
        dtype: str = "float32",
        vocab: int | None = None,
    ) -> FrozenModel:
        """A model read from `path` (an HF directory, a Hub model id, a Temper run or checkpoint) with its own
        shape, placed on `mesh` by its logical axes; its log-probs over its first `vocab` tokens (a teacher over
        its student's vocabulary). Reading never imports code the directory names."""
        from core.checkpoint_models import load_model_from

        with jax.set_mesh(mesh):
            model = load_model_from(path, mesh, dtype=dtype)
        return cls(name, model, mesh, LogprobPass(temperature, vocab), model.cfg)

    def logprobs(self, batch: PackedBatch) -> np.ndarray:
        """[B, C] log-probs of `batch`'s targets under this model, masked to 0 where there is no target (one of
        its packing groups at a time)."""
        return grouped_logprobs(self._pass, self.model, batch, self.mesh) * (np.asarray(batch.target_mask) > 0)
