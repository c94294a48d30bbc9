"""The distillation objective (offline top-k, online full-vocabulary and top-k) against float64 NumPy over both
models' full logits; micro-batches give the one-batch gradient; a padded teacher vocabulary is read over the
student's."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from core.config import ModelConfig, OptimConfig
from core.data import to_data_batch
from core.learner import Learner
from core.models import create_model
from posttrain.distill.objective import DistillBatch, DistillModules, DistillSettings, distill_objective
from tests.helpers import assert_same_gradients, recording_sgd

V = 64
STUDENT = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
TEACHER = ModelConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def rows(n=4, t=12, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, V, (n, t)).astype(np.int32)
    seg = np.zeros((n, t), np.int32)
    pos = np.zeros((n, t), np.int32)
    for r in range(n):
        length = rng.randint(7, t + 1)
        seg[r, :length] = 1
        pos[r, :length] = np.arange(length)
    mask = (seg > 0).astype(np.int32)
    mask[:, :3] = 0
    return {"tokens": tokens, "segment_ids": seg, "positions": pos, "loss_mask": mask, "example_ids": seg - 1}


def full_logits(model, packed) -> np.ndarray:
    """[B, C, V] float64 logits of every target slot, from the model's own full forward pass."""
    logits = np.asarray(model(packed.tokens, packed.positions, packed.segment_ids), np.float64)  # [R, L, V]
    flat = logits.reshape(-1, logits.shape[-1])
    return flat[np.asarray(packed.target_index)]


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def kl(a, b):  # KL(a || b) from log-probs, last axis
    return (np.exp(a) * (a - b)).sum(-1)


def divergence(logq, logp, kind, beta=0.5):
    if kind == "forward":
        return kl(logp, logq)
    if kind == "reverse":
        return kl(logq, logp)
    logm = np.logaddexp(logq + np.log(1 - beta), logp + np.log(beta))
    return beta * kl(logp, logm) + (1 - beta) * kl(logq, logm)


def reference(zs, zt, ids_label, kind, t, alpha, k=None, mode="renormalised", beta=0.5):
    """Per-slot loss over [B, C, V] logits in float64 (the top-k, when `k`, the teacher's at T)."""
    logq, logp = log_softmax(zs / t), log_softmax(zt / t)
    if k is not None:
        top = np.argsort(-zt, -1)[..., :k]
        logq, logp = np.take_along_axis(logq, top, -1), np.take_along_axis(logp, top, -1)
        if mode == "renormalised":
            logq, logp = log_softmax(logq), log_softmax(logp)
        else:
            tail = lambda x: np.concatenate([x, np.log(np.maximum(1 - np.exp(x).sum(-1, keepdims=True), 1e-12))], -1)
            logq, logp = tail(logq), tail(logp)
    kd = divergence(logq, logp, kind, beta)
    nll = -np.take_along_axis(log_softmax(zs), ids_label[..., None], -1)[..., 0]
    return (1 - alpha) * t * t * kd + alpha * nll


def objective_value(settings, student, batch, teacher=None, projections=None):
    """(the mean loss, the objective's `LossOutput`) of `batch`."""
    out = distill_objective(settings, student.cfg)(DistillModules(student, projections, teacher), batch, None)
    return float(out.total) / float(out.denominator), out


def make_batch(packed, alpha, t, **extra):
    b = packed.target_ids.shape[0]
    return DistillBatch(packed, np.full(b, alpha, np.float32), np.full(b, t, np.float32), **extra)


@pytest.mark.parametrize(
    "kind, mode",
    [("forward", "renormalised"), ("reverse", "renormalised"), ("jsd", "renormalised"), ("reverse", "tail")],
)
def test_offline_topk_matches_numpy(kind, mode):
    student, teacher = create_model(STUDENT, None, seed=0), create_model(TEACHER, None, seed=1)
    packed = to_data_batch(rows(), 1).batch
    zs, zt = full_logits(student, packed), full_logits(teacher, packed)
    k, t, alpha = 8, 2.0, 0.3
    # The dump: the teacher's top-k at T = 1 (renormalised reads it at any T; the tail needs the loss's T).
    dump_t = t if mode == "tail" else 1.0
    ids = np.argsort(-zt, -1)[..., :k].astype(np.int32)
    logp = np.take_along_axis(log_softmax(zt / dump_t), ids, -1).astype(np.float32)
    settings = DistillSettings(kind=kind, mode=mode, dump_temperature=dump_t, unit_temperature=False)
    got, out = objective_value(settings, student, make_batch(packed, alpha, t, teacher_ids=ids, teacher_logp=logp))
    mask = np.asarray(packed.target_mask) > 0
    want = reference(zs, zt, np.asarray(packed.target_ids), kind, t, alpha, k, mode)[mask].mean()
    assert got == pytest.approx(want, rel=2e-5)
    assert float(out.denominator) == mask.sum() > 10
    # Masses: the teacher's at the dump's temperature, the student's at T = 1.
    mass = np.exp(np.take_along_axis(log_softmax(zt / dump_t), ids, -1)).sum(-1)[mask].mean()
    assert float(out.sums.teacher_mass) / mask.sum() == pytest.approx(mass, rel=1e-5)
    mass = np.exp(np.take_along_axis(log_softmax(zs), ids, -1)).sum(-1)[mask].mean()
    assert float(out.sums.student_mass) / mask.sum() == pytest.approx(mass, rel=1e-5)


def test_a_saturated_students_tail_bucket_comes_from_its_logits_outside_the_topk():
    """Tail mode through the objective where the student's top-k mass rounds to 1 in float32 (a low temperature):
    its tail bucket is its log-mass outside the k, from its logits (`student_tail`), as in float64 NumPy; not the
    floor that 1 - sum_k would give (the loss-level test's gradient, turned around, in tests/test_distill_losses.py)."""
    student = create_model(STUDENT, None, seed=0)
    packed = to_data_batch(rows(), 1).batch
    zs = full_logits(student, packed)
    mask = np.asarray(packed.target_mask) > 0
    k = 8
    order = np.argsort(-zs, -1)
    ids = order[..., :k].astype(np.int32)  # the dump's ids: the student's own top-k (the saturated case)
    ranked = np.take_along_axis(zs, order, -1)
    t = float((ranked[..., k - 1] - ranked[..., k])[mask].min()) / 20  # every slot's tail below e^-20 at T
    logq = log_softmax(zs / t)
    logq_k = np.take_along_axis(logq, ids, -1)
    outside = np.ones_like(zs, bool)
    np.put_along_axis(outside, ids, False, -1)
    rest = np.where(outside, logq, -np.inf)
    top_rest = rest.max(-1, keepdims=True)
    tail_q = np.log(np.exp(rest - top_rest).sum(-1)) + top_rest[..., 0]  # log-mass outside the k, in float64
    assert (tail_q[mask] < -20 + 1e-6).all()  # the branch: 1 - sum_k is below float32's resolution at 1
    assert (np.float32(1) - np.exp(logq_k.astype(np.float32)).sum(-1, dtype=np.float32))[mask].max() < 1e-6
    p_k = np.full(k, 0.99 / k)  # the teacher: 1% outside its top-k
    logp = np.broadcast_to(np.log(p_k), ids.shape).astype(np.float32)
    settings = DistillSettings(kind="forward", mode="tail", dump_temperature=t, unit_temperature=False)
    got, _ = objective_value(settings, student, make_batch(packed, 0.0, t, teacher_ids=ids, teacher_logp=logp))
    kd = (p_k * (np.log(p_k) - logq_k)).sum(-1) + 0.01 * (np.log(0.01) - tail_q)
    want = (t * t * kd)[mask].mean()
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("kind", ["forward", "jsd"])  # reverse: the kernel's own tests and online top-k below
def test_online_full_vocabulary_matches_numpy(kind):
    student, teacher = create_model(STUDENT, None, seed=0), create_model(TEACHER, None, seed=1)
    packed = to_data_batch(rows(seed=1), 1).batch
    zs, zt = full_logits(student, packed), full_logits(teacher, packed)
    settings = DistillSettings(kind=kind, beta=0.3, unit_temperature=False)
    got, out = objective_value(settings, student, make_batch(packed, 0.25, 1.5), teacher)
    mask = np.asarray(packed.target_mask) > 0
    want = reference(zs, zt, np.asarray(packed.target_ids), kind, 1.5, 0.25, beta=0.3)[mask].mean()
    assert got == pytest.approx(want, rel=2e-5)
    kl1 = kl(log_softmax(zt), log_softmax(zs))[mask].mean()  # the run-comparable metric: forward KL at T = 1
    assert float(out.sums.kl) / mask.sum() == pytest.approx(kl1, rel=2e-5)


def test_online_topk_matches_numpy():
    student, teacher = create_model(STUDENT, None, seed=0), create_model(TEACHER, None, seed=1)
    packed = to_data_batch(rows(seed=2), 1).batch
    zs, zt = full_logits(student, packed), full_logits(teacher, packed)
    settings = DistillSettings(kind="reverse", top_k=5, unit_temperature=False)
    got, _ = objective_value(settings, student, make_batch(packed, 0.0, 2.0), teacher)
    mask = np.asarray(packed.target_mask) > 0
    want = reference(zs, zt, np.asarray(packed.target_ids), "reverse", 2.0, 0.0, k=5)[mask].mean()
    assert got == pytest.approx(want, rel=2e-5)


def test_padded_teacher_vocabulary_is_read_over_the_students():
    """A teacher with 8 extra output rows (Qwen2.5's 152,064 vs 151,936) gives the loss of its first V rows."""
    student = create_model(STUDENT, None, seed=0)
    padded = create_model(TEACHER.model_copy(update={"vocab_size": V + 8}), None, seed=1)
    packed = to_data_batch(rows(seed=3), 1).batch
    zs, zt = full_logits(student, packed), full_logits(padded, packed)
    assert zt.shape[-1] == V + 8
    settings = DistillSettings(kind="forward")
    got, _ = objective_value(settings, student, make_batch(packed, 0.0, 1.0), padded)
    mask = np.asarray(packed.target_mask) > 0
    want = reference(zs, zt[..., :V], np.asarray(packed.target_ids), "forward", 1.0, 0.0)[mask].mean()
    assert got == pytest.approx(want, rel=2e-5)
    with_padding = reference(zs, zt[..., :V], np.asarray(packed.target_ids), "forward", 1.0, 0.0)
    assert np.isfinite(with_padding).all()


def layer_states_at_targets(model, packed, layers) -> np.ndarray:
    """[B, C, n, D] float64: the residual stream after each of `layers` at every target slot's position."""
    _, states = model.layer_states(packed.tokens, packed.positions, packed.segment_ids, layers=layers)
    flat = [np.asarray(h, np.float64).reshape(-1, h.shape[-1]) for h in states]
    return np.stack([h[np.asarray(packed.target_index)] for h in flat], axis=-2)


@pytest.mark.parametrize("kind", ["cosine", "l2"])
def test_feature_loss_through_a_projection_matches_numpy(kind):
    """Online with feature pairs (student 1 <-> teacher 2, student 1 <-> teacher 1; widths 32 -> 48): the loss is
    the KD's plus the weight times the pairs' mean feature loss of (student states @ projection, teacher states),
    float64 NumPy; the projection's gradient (l2) is NumPy's closed form, and not zero."""
    import jax
    from flax import nnx

    from posttrain.distill.features import feature_projections

    student, teacher = create_model(STUDENT, None, seed=0), create_model(TEACHER, None, seed=1)
    packed = to_data_batch(rows(seed=6), 1).batch
    pairs = ((1, 2), (1, 1))
    projections = feature_projections(pairs, STUDENT.hidden_size, TEACHER.hidden_size, seed=3)
    assert projections is not None and feature_projections(pairs, 32, 32, seed=3) is None  # equal widths: none
    weight, t, alpha = 0.7, 1.0, 0.0
    settings = DistillSettings(kind="forward", feature_layers=pairs, feature_kind=kind)
    b = packed.target_ids.shape[0]
    batch = make_batch(packed, alpha, t, feature_weight=np.full(b, weight, np.float32))
    got, out = objective_value(settings, student, batch, teacher, projections)

    mask = np.asarray(packed.target_mask) > 0
    hs = layer_states_at_targets(student, packed, (1, 1))[mask]  # [N, 2, 32]
    ht = layer_states_at_targets(teacher, packed, (2, 1))[mask]  # [N, 2, 48]
    kernels = [np.asarray(k[...], np.float64) for k in projections.kernels]
    proj = np.stack([hs[:, i] @ kernels[i] for i in range(2)], axis=1)  # [N, 2, 48]
    if kind == "cosine":
        cos = (proj * ht).sum(-1) / (np.linalg.norm(proj, axis=-1) * np.linalg.norm(ht, axis=-1))
        feature = (1 - cos).mean(-1)
    else:
        feature = ((proj - ht) ** 2).mean(-1).mean(-1)
    kd = reference(full_logits(student, packed), full_logits(teacher, packed), np.asarray(packed.target_ids),
                   "forward", t, alpha)[mask]  # fmt: skip
    assert got == pytest.approx((kd + weight * feature).mean(), rel=2e-5)
    assert float(out.sums.feature) / mask.sum() == pytest.approx(feature.mean(), rel=2e-5)
    assert feature.mean() > 0.05  # a real distance, not a degenerate zero

    if kind == "l2":  # d/dP_i of mean_tokens weight * mean_pairs mean_d (h_i P_i - t_i)^2
        loss_fn = distill_objective(settings, STUDENT)
        graphdef, state = nnx.split(projections)

        def loss_of(p):
            out = loss_fn(DistillModules(student, nnx.merge(graphdef, p), teacher), batch, None)
            return out.total / out.denominator

        grads = jax.grad(loss_of)(state)
        n, dt = hs.shape[0], ht.shape[-1]
        for i in range(2):
            want = weight * 2.0 / (n * 2 * dt) * hs[:, i].T @ (proj[:, i] - ht[:, i])
            got_grad = np.asarray(grads["kernels"][i].get_value())
            assert np.abs(want).max() > 1e-4
            np.testing.assert_allclose(got_grad, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("online", [False, True, "features"])
def test_micro_batches_give_the_one_batch_gradient(online):
    """Two micro-batches and one give the same gradient, per tensor in float32 ulps, and it is not zero; with
    feature pairs, the projection (trained with the student in the method's module tree) gets its gradient the
    same way."""
    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import trainable

    data = rows(n=8, seed=4)
    teacher = create_model(TEACHER, None, seed=1)
    pairs = ((1, 2),) if online == "features" else ()
    k = 6
    zt = full_logits(teacher, to_data_batch(data, 1).batch)  # per [B, C] slot: the same slots in both layouts
    ids = np.argsort(-zt, -1)[..., :k].astype(np.int32)
    dump = dict(teacher_ids=ids, teacher_logp=np.take_along_axis(log_softmax(zt), ids, -1).astype(np.float32))
    grads = []
    for micro in (1, 2):
        packed = to_data_batch(data, micro).batch
        extra = {} if online else dump
        if pairs:
            extra = {"feature_weight": np.full(8, 0.5, np.float32)}
        batch = make_batch(packed, 0.2, 2.0, **extra)
        settings = DistillSettings(kind="jsd", top_k=0 if online else k, unit_temperature=False, feature_layers=pairs)
        projections = feature_projections(pairs, STUDENT.hidden_size, TEACHER.hidden_size, seed=0)
        learner = Learner(
            DistillModules(create_model(STUDENT, None, seed=0), projections, teacher if online else None),
            mesh(),
            distill_objective(settings, STUDENT),
            OptimConfig(name="sgd", learning_rate=0.0, schedule="constant", grad_clip_norm=None),
            total_updates=1,
            tx=recording_sgd(0.0),
            trainable=trainable(nnx.Param),
        )
        update = learner.update(batch, micro)
        assert update.finite == 1.0 and update.empty == 0.0 and update.grad_norm > 0
        grads.append(learner.state.opt_state)  # the gradient the update was given
        assert "teacher" not in learner.state.params  # frozen: no gradient, no moments
    if pairs:  # the projections' gradient is there, and checked tensor by tensor
        assert np.abs(np.asarray(grads[0]["projections"]["kernels"][0])).max() > 0
    assert_same_gradients(grads[0], grads[1])


def mesh():
    import jax

    from core.config import MeshConfig
    from core.mesh import make_mesh

    return make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
