"""Models that do not train beside the one that does: a reference (GRPO's KL, DPO) or a teacher (distillation).

    reference = FrozenModel.start_of(learner)           # the learner's starting parameters, held still
    teacher = FrozenModel.load("Qwen/Qwen2.5-1.5B-Instruct", mesh, "teacher")    # any checkpoint, its own shape
    logp = reference.logprobs(batch, groups=4)          # [B, C] float32 on the host, one packing group at a time
    logp = grouped_logprobs(logprob_pass(graphdef, 1.0), params, batch, groups, mesh)   # the same, any parameters

A frozen model is either a copy of the learner's starting parameters (a reference) or read from any checkpoint
with the shape it was saved with (an HF directory, a Hub id, a Temper run: `core.checkpoint.load_model_from`;
a teacher larger or smaller than the learner, `cfg` its model config). Log-probs are computed live, per batch,
by one jitted pass over the packed batch's targets (`core.targets.target_logprobs`), a packing group (one
micro-batch's rows) at a time so that memory stays that of one micro-batch; `posttrain.token_store` keeps
values computed once instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from core.batch import PackedBatch
from core.config import ModelConfig
from core.distributed import CompiledTogether, to_host
from core.learner import Learner
from core.targets import states_logprobs, target_logprobs, target_states
from core.train import place_batch, split_micro_batches


def logprob_pass(graphdef: nnx.GraphDef, temperature: float, vocab: int | None = None) -> Callable:
    """A jitted `(params, packed group) -> [B_g, C]` log-probs of the targets (normalised over the first `vocab`
    tokens: a teacher's padded embedding read over its student's vocabulary; None: all its rows)."""
    if vocab is None:
        return CompiledTogether(
            jax.jit(
                lambda params, batch: target_logprobs(nnx.merge(graphdef, params), batch, temperature, entropy=False)[0]
            ),
            "a log-prob pass",
        )

    def over_vocab(params, batch):
        model = nnx.merge(graphdef, params)
        states = target_states(model, batch).over_vocab(vocab)
        return states.to_slots(states_logprobs(model.cfg, states, temperature)[0])

    return CompiledTogether(jax.jit(over_vocab), "a log-prob pass")


def grouped_logprobs(fn: Callable, params: nnx.State, batch: PackedBatch, groups: int, mesh: Mesh) -> np.ndarray:
    """[B, C] float32 host log-probs of every target, computed one packing group at a time."""
    placed = place_batch(split_micro_batches(batch, groups, mesh), mesh)
    out = []
    with jax.set_mesh(mesh):
        for i in range(groups):
            part = jax.tree.map(lambda x, i=i: x[i], placed)
            out.append(to_host(fn(params, part)))  # a collective in a process group
    return np.concatenate(out).astype(np.float32)


@dataclass
class FrozenModel:
    """Parameters that never change, on the trainer mesh, and their jitted log-prob pass."""

    name: str  # "reference", "teacher": what the method calls it
    params: nnx.State
    mesh: Mesh
    _pass: Callable
    cfg: ModelConfig | None = None  # its shape (vocabulary, layers, width)

    @classmethod
    def copy_of(
        cls,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        mesh: Mesh,
        name: str,
        temperature: float = 1.0,
        cfg: ModelConfig | None = None,
    ) -> FrozenModel:
        """A frozen copy of `params` (the trainer's next update donates its own buffers)."""
        with jax.set_mesh(mesh):
            copied = jax.tree.map(jnp.copy, params)
        return cls(name, copied, mesh, logprob_pass(graphdef, temperature), cfg)

    @classmethod
    def start_of(cls, learner: Learner, name: str = "reference", temperature: float = 1.0) -> FrozenModel:
        """The learner's parameters as they are now (before its first update: where the policy started), frozen:
        the reference every method that has one uses."""
        return cls.copy_of(learner.graphdef, learner.params, learner.mesh, name, temperature, learner.model_cfg)

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
        from core.checkpoint import load_model_from

        with jax.set_mesh(mesh):
            model = load_model_from(path, mesh, dtype=dtype)
        graphdef, params = nnx.split(model)
        return cls(name, params, mesh, logprob_pass(graphdef, temperature, vocab), model.cfg)

    def logprobs(self, batch: PackedBatch, groups: int) -> np.ndarray:
        """[B, C] log-probs of `batch`'s targets under this model, masked to 0 where there is no target."""
        return grouped_logprobs(self._pass, self.params, batch, groups, self.mesh) * (np.asarray(batch.target_mask) > 0)
