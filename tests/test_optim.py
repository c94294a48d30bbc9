"""Schedules against hand-computed values; weight-decay mask; freezing; Muon."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import ModelConfig, OptimConfig
from core.models import create_model
from core.optim import make_optimizer, make_schedule, trainable_paths


def lr(cfg, total, steps):
    s = make_schedule(cfg, total)
    return [float(s(i)) for i in steps]


def test_constant_with_warmup():
    c = OptimConfig(schedule="constant", learning_rate=1.0, warmup_steps_fraction=0.1)
    assert lr(c, 100, [0, 5, 10, 50, 99]) == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])


def test_cosine_with_warmup():
    c = OptimConfig(schedule="cosine", learning_rate=2.0, warmup_steps_fraction=0.2, learning_rate_final_fraction=0.1)
    total, warm = 50, 10

    def hand(i):
        if i < warm:
            return 2.0 * i / warm
        t = (i - warm) / (total - warm)
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    steps = [0, 4, 10, 20, 30, 45, 50]
    assert lr(c, total, steps) == pytest.approx([hand(i) for i in steps], rel=1e-5)


def test_wsd():
    c = OptimConfig(
        schedule="wsd",
        learning_rate=1.0,
        warmup_steps_fraction=0.1,
        wsd_decay_steps_fraction=0.2,
        learning_rate_final_fraction=0.0,
    )
    # 100 steps: warm-up 0-10, stable 10-80, linear decay 80-100 to 0
    assert lr(c, 100, [0, 5, 10, 50, 79, 80, 90, 100]) == pytest.approx([0, 0.5, 1, 1, 1, 1, 0.5, 0], abs=1e-6)


@functools.lru_cache(maxsize=1)
def tiny_params():
    model = create_model(ModelConfig(family="qwen2", attention_bias=True), seed=0)
    return model, nnx.state(model)


def grads_like(params, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 100))
    return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), params)


def test_weight_decay_skips_norms_and_biases():
    _, params = tiny_params()
    c = OptimConfig(name="adamw", learning_rate=0.1, weight_decay=0.5, schedule="constant", grad_clip_norm=None)
    tx = make_optimizer(c, 10, params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)  # zero gradient: only weight decay moves things
    flat_u, flat_p = dict(nnx.to_flat_state(updates)), dict(nnx.to_flat_state(params))
    for path, u in flat_u.items():
        name = ".".join(map(str, path))
        if name.endswith((".scale", ".bias")):
            assert not np.asarray(u[...]).any(), name
        else:
            np.testing.assert_allclose(np.asarray(u[...]), -0.1 * 0.5 * np.asarray(flat_p[path][...]), rtol=1e-6)


def _regex_learner(regex: str):
    from core.learner import Learner
    from core.losses import nll_loss
    from core.mesh import single_device_mesh

    model, _ = tiny_params()
    c = OptimConfig(name="adamw", learning_rate=0.1, trainable_regex=regex, schedule="constant")
    return Learner(model, single_device_mesh(), nll_loss, c, total_updates=3)


def test_trainable_regex_is_the_learners_filter_frozen_parameters_get_no_gradient_or_state():
    """`optim.trainable_regex` narrows what trains: the learner's trainable state holds the matching parameters
    alone (no gradient buffer, no moment for the rest, and a checkpoint holds only them); an update moves them and
    leaves every other parameter as it was."""
    from tests.test_train_step import make_batch, packed

    learner = _regex_learner(r"mlp\.")
    trained = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.params)]
    frozen = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(learner.rest)]
    assert trained and all("mlp." in p for p in trained), trained
    assert any("attn" in p for p in frozen) and not any("mlp." in p for p in frozen), frozen
    moments = [leaf for leaf in jax.tree.leaves(learner.state.opt_state) if leaf.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(learner.params))
    before = jax.tree.map(np.asarray, learner.rest)
    trained_before = jax.tree.map(np.asarray, learner.params)
    update = learner.update(packed(make_batch(rows=4, t=12)), 1)
    assert update.applied and update.grad_norm > 0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(learner.rest), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    moved = [
        not np.array_equal(x, np.asarray(y))
        for x, y in zip(jax.tree.leaves(trained_before), jax.tree.leaves(learner.params))
    ]
    assert all(moved)


def test_trainable_regex_matching_nothing():
    with pytest.raises(ValueError, match="matches no parameter"):
        _regex_learner("nothing_like_this")


@pytest.mark.parametrize("name", ["sgd", "muon"])
def test_other_optimizers_step(name):
    _, params = tiny_params()
    tx = make_optimizer(OptimConfig(name=name, learning_rate=0.01, schedule="constant"), 10, params)
    updates, _ = jax.jit(tx.update)(grads_like(params), tx.init(params), params)
    assert all(np.isfinite(np.asarray(u)).all() and np.asarray(u).any() for u in jax.tree.leaves(updates))


def test_trainable_regex_reads_the_paths_of_a_module_tree():
    """In a method's module tree (a model and a feature projection trained with it) `trainable_regex` matches each
    parameter's path in the tree: `mlp\\.|projections` trains the model's MLPs and the projection, nothing else
    of the model."""
    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import DistillModules, trainable

    model, _ = tiny_params()
    tree = DistillModules(model, feature_projections([(1, 1)], 64, 32, seed=0))
    params = nnx.state(tree, trainable_paths(trainable(nnx.Param), r"mlp\.|projections"))
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(params)]
    assert any(p.startswith("projections.") for p in paths) and any(p.startswith("model.") for p in paths)
    assert all(p.startswith("projections.") or ".mlp." in p for p in paths), paths
    # One clip at optim.grad_clip_norm over every trainable parameter of the tree (SGD shows it: AdamW's first step
    # does not depend on the scale).
    whole = nnx.state(tree, trainable(nnx.Param))
    tx = make_optimizer(OptimConfig(name="sgd", learning_rate=0.1, schedule="constant", grad_clip_norm=1.0), 10, whole)
    grads = jax.tree.map(jnp.ones_like, whole)
    updates, _ = tx.update(grads, tx.init(whole), whole)
    norm = np.sqrt(sum(x.size for x in jax.tree.leaves(whole)))  # of the all-ones gradient of the whole tree
    np.testing.assert_allclose(np.asarray(updates["projections"]["kernels"][0]), -0.1 / norm, rtol=1e-5)
