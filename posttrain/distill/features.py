"""Feature distillation: the student's hidden states at chosen layers pulled towards the teacher's.

    projections = feature_projections(pairs, student_width=256, teacher_width=512, seed=0)   # None: equal widths
    f = feature_term(student_states.features, teacher_states.features, "cosine", projections)   # [F]

Each pair (student layer, teacher layer) compares the residual stream after those decoder layers
(`core.models.Decoder.layer_states`) at the loss's target positions, with `posttrain.losses.distill.feature_loss`
(1 - cosine similarity, or the mean squared difference), averaged over the pairs. When the widths differ the
student's states go through a learned [Ds, Dt] map per pair (Tunix's feature strategies; FitNets' regressor,
Romero et al., 2015): it is part of the method's module tree (`posttrain.distill.objective.DistillModules`), trained
with the student, checkpointed
with it, and never part of the exported model.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.losses.distill import FeatureKind, feature_loss


class FeatureProjections(nnx.Module):
    """One learned [Ds, Dt] projection per feature pair (LeCun-normal init, float32)."""

    def __init__(self, pairs: int, student_width: int, teacher_width: int, rngs: nnx.Rngs):
        init = jax.nn.initializers.lecun_normal()
        self.kernels = nnx.List(
            [nnx.Param(init(rngs.params(), (student_width, teacher_width), jnp.float32)) for _ in range(pairs)]
        )


def feature_projections(
    pairs: Sequence[tuple[int, int]], student_width: int, teacher_width: int, seed: int
) -> FeatureProjections | None:
    """The projections a run trains beside the student, or None when the widths agree (compared as they are)."""
    if not pairs or student_width == teacher_width:
        return None
    return FeatureProjections(len(pairs), student_width, teacher_width, nnx.Rngs(params=seed))


def feature_term(
    student: jax.Array, teacher: jax.Array, kind: FeatureKind, projections: FeatureProjections | None
) -> jax.Array:
    """[F, n, Ds] student and [F, n, Dt] teacher states (n pairs, `core.targets.TargetStates.features`) -> [F]:
    the feature loss averaged over the pairs."""
    n = student.shape[1]
    terms = [
        feature_loss(student[:, i], teacher[:, i], kind, None if projections is None else projections.kernels[i][...])
        for i in range(n)
    ]
    return jnp.mean(jnp.stack(terms), axis=0)
