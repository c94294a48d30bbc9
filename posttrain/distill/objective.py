"""The distillation objective of the offline and online regimes: its batch, its loss, its metrics.

    batch = DistillBatch(packed, alpha=a, temperature=t, teacher_ids=ids, teacher_logp=logp)   # offline
    batch = DistillBatch(packed, alpha=a, temperature=t)                                       # online
    loss_fn = distill_objective(settings, model_cfg)   # (DistillModules, batch, rng) -> LossOutput

Per target token, with p the teacher's and q the student's distribution at temperature T:

    loss = (1 - alpha) * T^2 * D(p, q) + alpha * NLL(target)        (T^2 with `t2_scaling`; NLL at T = 1)
           [+ feature_weight * F(student states, teacher states)]  (online, `feature_layers`: `features`)

D is `posttrain.losses.distill`'s divergence (forward KL, reverse KL or JSD(beta)), over

- the teacher's top-k, read from the batch (offline: `teacher_ids` / `teacher_logp`, dumped at `dump_temperature`
  and rescaled to T) or found in the step (online with `top_k`: `core.kernels.divergence.chunked_topk` on the
  teacher's hidden states), renormalised or with a tail bucket (`topk_divergence`); the student's log-probs at
  those ids are its logits there minus its log-sum-exp (from the vocabulary-tiled log-prob head);
- the whole vocabulary (online, top_k = 0): `core.kernels.divergence.chunked_divergence` from both models' final
  hidden states and output weights, never a [tokens, vocab] array of either.

alpha, T and the feature weight arrive per row (every row the same value: the step's point on its schedule,
`schedules`), so that a schedule changes no compiled shape: T divides the hidden states (h W / T = (h / T) W),
not a static argument.
The loss is a sum over target tokens and its denominator their count, so micro-batches and packing leave the
gradient unchanged (`core.train`). The module tree (`DistillModules`) holds the student (`model`, what trains),
its feature projections (trained with it) and the online regime's teacher (frozen: the method's trainable filter,
`trainable`, leaves it out). Metrics, per target token: `kd` (D at T), `kl` (forward KL at T = 1 over the
same support: comparable across runs whatever T and loss), `nll`, and on a top-k `teacher_mass` / `student_mass`
(each model's probability on the teacher's top-k at T = 1: a student shrinking its own mass there shows), with
feature layers `feature` (F, before its weight). Offline,
the teacher's side of both is the dump's values (taken at `dump_temperature`, 1 by default: the same T = 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.batch import PackedBatch
from core.kernels.divergence import Divergence, chunked_divergence, chunked_topk
from core.kernels.logprobs import excluded_logsumexp
from core.models import Decoder, ModuleTree
from core.sums import summed
from core.targets import TargetStates, states_logprobs, target_states
from core.train import LossFn, LossOutput
from posttrain.config import SCHEDULED
from posttrain.distill.features import FeatureProjections, feature_term
from posttrain.losses.distill import FeatureKind, TopKMode, mix_hard_label, scheduled, topk_divergence, topk_mass

_BLOCK = 256  # target tokens per block when gathering the student's logits at the teacher's top-k ids


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DistillBatch:
    packed: PackedBatch
    # The schedules' values at the update the batch trains at (`schedules`; a dataset run's `Distillation.attach`
    # sets them where the trainer's step is known):
    alpha: Any = None  # [B] float32: the hard-label weight at this step, the same in every row
    temperature: Any = None  # [B] float32: T at this step, the same in every row
    teacher_ids: Any = None  # [B, C, k] int32: the teacher's top-k per target slot (offline); None: online
    teacher_logp: Any = None  # [B, C, k] float32: their log-probs at the dump's temperature
    feature_weight: Any = None  # [B] float32: the feature loss's weight at this step (online with feature layers)

    def replace(self, **changes: Any) -> DistillBatch:
        return dataclasses.replace(self, **changes)


class DistillModules(ModuleTree):
    """What distillation's step reads: the student (trained), its feature projections (trained with it; None when
    the widths agree or there is no feature loss) and the teacher (frozen; None when its values come with the
    batch: a dump, a teacher actor)."""

    def __init__(self, model: Decoder, projections: FeatureProjections | None = None, teacher: Decoder | None = None):
        super().__init__(model)
        self.projections = nnx.data(projections)
        self.teacher = nnx.data(teacher)


def trainable(model_filter: Any) -> Any:
    """What trains in `DistillModules`: the student's trainable parameters (`model_filter`: every one, or its LoRA
    adapters) and the feature projections; never the teacher."""
    return nnx.Any(nnx.All(nnx.PathContains("model"), model_filter), nnx.PathContains("projections"))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DistillSums:
    """What the objective sums over a micro-batch's target tokens (means per target token in the logs); the top-k
    masses only on a top-k support, the feature term only with feature layers."""

    kd: Any = summed()  # D at T
    kl: Any = summed()  # forward KL at T = 1 over the same support
    nll: Any = summed()
    teacher_mass: Any = summed(default=None)
    student_mass: Any = summed(default=None)
    feature: Any = summed(default=None)


@dataclass(frozen=True)
class DistillSettings:
    """The static part of the objective (what its compiled step depends on)."""

    kind: Divergence = "forward"
    beta: float = 0.5
    top_k: int = 0  # online: 0 = the whole vocabulary; offline: unused (the batch holds the top-k)
    mode: TopKMode = "renormalised"
    t2_scaling: bool = True
    dump_temperature: float = 1.0  # offline: the temperature the stored log-probs were taken at
    unit_temperature: bool = True  # T = 1 at every step: no separate pass for the T = 1 metrics
    # Online: (student layer, teacher layer) pairs whose hidden states the feature loss compares (`features`).
    feature_layers: tuple[tuple[int, int], ...] = ()
    feature_kind: FeatureKind = "cosine"


def schedules(cfg, step: int, total: int, rows: int) -> dict[str, np.ndarray]:
    """{"alpha", "temperature", "feature_weight"}: [rows] each, the value at update `step` (0-based) of `total`
    (`cfg`: the `distill` section): the start value at the first update, the end value at the last. The keys are
    `DistillBatch`'s fields."""
    values = {}
    for name in SCHEDULED:
        start, end, kind = cfg.at(name)
        values[name] = np.full((rows,), float(scheduled(start, end, kind, step, total - 1)), np.float32)
    return values


def _logits_at(states: TargetStates, ids: jax.Array) -> jax.Array:
    """[F, k] the model's logits (of `states.hidden`, [F, D]) at `ids` [F, k], a block of targets at a time and
    rematerialised in the backward pass, so that the gathered weight columns ([block, k, D]) are never held for
    every target at once."""
    f, k = ids.shape
    pad = (-f) % _BLOCK
    h = jnp.pad(states.hidden, ((0, pad), (0, 0))).reshape(-1, _BLOCK, states.hidden.shape[-1])
    i = jnp.pad(ids, ((0, pad), (0, 0))).reshape(-1, _BLOCK, k)
    rows = states.weight.T if states.layout == "dv" else states.weight  # [V, D]

    @jax.checkpoint
    def block(args):
        hb, ib = args
        return jnp.einsum("ND,NKD->NK", hb, rows[ib], preferred_element_type=jnp.float32)

    return jax.lax.map(block, (h, i)).reshape(-1, k)[:f]


def _logits_and_label(states: TargetStates, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([F, k] logits at `ids`, [F] logits at each target token) in one gather of k + 1 weight rows per target."""
    z = _logits_at(states, jnp.concatenate([ids, states.ids[:, None].astype(ids.dtype)], axis=1))
    return z[:, :-1], z[:, -1]


def distill_objective(settings: DistillSettings, model_cfg) -> LossFn:
    """The loss of `DistillBatch` (module docstring); `teacher` is the frozen model of the online regime."""

    student_layers = tuple(s for s, _ in settings.feature_layers)
    teacher_layers = tuple(t for _, t in settings.feature_layers)

    def loss_fn(modules: DistillModules, batch: DistillBatch, rng: jax.Array | None) -> LossOutput:
        model, teacher, projections = modules.model, modules.teacher, modules.projections
        packed = batch.packed
        student = target_states(model, packed, student_layers, rng=rng, routed=True)  # what sampled (on-policy)
        # The teacher routes as its own routers do: the batch's routes are the student sampler's.
        teacher_states = None if teacher is None else target_states(teacher, packed, teacher_layers)
        mask = student.from_slots(packed.target_mask)  # [F]: 0 on the list's padding
        alpha, temperature = batch.alpha[0], batch.temperature[0]
        h_t = student.hidden / temperature.astype(student.hidden.dtype)
        logp1, _ = states_logprobs(model_cfg, student)  # [F] log q(target) at T = 1
        if settings.unit_temperature:
            logp_t = logp1
        else:
            logp_t, _ = states_logprobs(model_cfg, dataclasses.replace(student, hidden=h_t))
        sums: dict[str, Any] = {}
        if teacher_states is not None and settings.top_k == 0:
            kd, kl = _full_vocabulary(settings, model_cfg, student, h_t, teacher_states, temperature)
        else:
            online_teacher_tail = None
            if teacher is not None and teacher_states is not None:  # online, top-k: the teacher's at T, in the step
                vocab = student.weight.shape[1 if student.layout == "dv" else 0]
                teacher_t = teacher_states.hidden / temperature.astype(teacher_states.hidden.dtype)
                ids, logp = chunked_topk(
                    teacher_t,
                    teacher_states.weight,
                    settings.top_k,
                    teacher.cfg.vocab_chunk_size,
                    teacher_states.layout,
                    vocab,
                )
                if settings.mode == "tail":
                    at_t = dataclasses.replace(teacher_states, hidden=teacher_t).over_vocab(vocab)
                    z_top = _logits_at(at_t, ids[:, :1])[:, 0]  # the top id's logit at T: lse_T = z - log p
                    online_teacher_tail = _tail_logmass(teacher.cfg, at_t, ids) - (z_top - logp[:, 0])
                if settings.unit_temperature:
                    logp1_teacher = logp
                else:
                    logp1_teacher = _logprobs_at(teacher.cfg, teacher_states.over_vocab(vocab), ids)
            else:  # offline: the dump's, rescaled from its temperature to T
                ids = student.from_slots(batch.teacher_ids)
                stored = student.from_slots(batch.teacher_logp).astype(jnp.float32)
                logp = stored * (settings.dump_temperature / temperature)
                logp1_teacher = stored  # at the dump's temperature (1 by default): what the metrics read
            z, z_label = _logits_and_label(student, ids)  # [F, k], [F] at T = 1
            lse1 = z_label - logp1
            lse_t = z_label / temperature - logp_t
            logq = z / temperature - lse_t[:, None]
            student_tail = teacher_tail = None
            if settings.mode == "tail":  # each bucket from the logits outside the top-k, not from 1 - sum_k
                student_tail = _tail_logmass(model_cfg, dataclasses.replace(student, hidden=h_t), ids) - lse_t
                teacher_tail = online_teacher_tail
            kd = topk_divergence(logq, logp, settings.kind, settings.mode, settings.beta, student_tail, teacher_tail)
            logq1 = jax.lax.stop_gradient(z - lse1[:, None])
            kl = topk_divergence(logq1, logp1_teacher, "forward", settings.mode)
            sums["teacher_mass"] = jnp.sum(topk_mass(logp1_teacher) * mask)
            sums["student_mass"] = jnp.sum(topk_mass(logq1) * mask)
        nll = -logp1
        per_token = mix_hard_label(kd, nll, alpha, temperature, settings.t2_scaling)
        if settings.feature_layers:
            assert teacher_states is not None and student.features is not None and teacher_states.features is not None
            f = feature_term(student.features, teacher_states.features, settings.feature_kind, projections)
            per_token = per_token + batch.feature_weight[0] * f
            sums["feature"] = jnp.sum(jax.lax.stop_gradient(f) * mask)
        sums.update(
            kd=jnp.sum(jax.lax.stop_gradient(kd) * mask),
            kl=jnp.sum(jax.lax.stop_gradient(kl) * mask),
            nll=jnp.sum(jax.lax.stop_gradient(nll) * mask),
        )
        return LossOutput(jnp.sum(per_token * mask), jnp.sum(mask), DistillSums(**sums))

    return loss_fn


def _full_vocabulary(settings, model_cfg, student: TargetStates, h_t, teacher: TargetStates, temperature):
    """([F] D at T over the whole vocabulary, [F] forward KL at T = 1, no gradient) from both models' states."""
    chunk = model_cfg.vocab_chunk_size

    def divergence(hs, ht, kind, beta):
        return chunked_divergence(
            hs, student.weight, ht, teacher.weight, kind, 1.0, beta, chunk, student.layout, teacher.layout
        )

    kd = divergence(h_t, teacher.hidden / temperature.astype(teacher.hidden.dtype), settings.kind, settings.beta)
    if settings.unit_temperature and settings.kind == "forward":
        return kd, kd
    sg = jax.lax.stop_gradient
    return kd, divergence(sg(student.hidden), teacher.hidden, "forward", 0.5)


def _tail_logmass(model_cfg, states: TargetStates, ids: jax.Array) -> jax.Array:
    """[F] log sum over the vocabulary outside `ids` [F, k] of exp(the model's logits) (`states.hidden` already at
    the temperature): subtract the log-sum-exp over everything for the bucket's log-probability."""
    return excluded_logsumexp(
        states.hidden, states.weight, ids, chunk_size=model_cfg.vocab_chunk_size, layout=states.layout
    )


def _logprobs_at(model_cfg, states: TargetStates, ids: jax.Array) -> jax.Array:
    """[F, k] a model's log-probs at T = 1 at `ids`, no gradient (online top-k at T != 1: the teacher's T = 1
    values the metrics read, from the hidden states its top-k pass already has)."""
    z, z_label = _logits_and_label(states, ids)
    logp1, _ = states_logprobs(model_cfg, states)
    return jax.lax.stop_gradient(z - (z_label - logp1)[:, None])
