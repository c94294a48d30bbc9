"""Schedules against hand-computed values; weight-decay mask; freezing; Muon."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core.config import ModelConfig, OptimConfig
from core.models import create_model
from core.optim import make_optimizer, make_schedule, trainable_labels


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


def test_freezing_is_exact_and_stateless():
    _model, params = tiny_params()
    c = OptimConfig(name="adamw", learning_rate=0.1, trainable_regex=r"mlp\.", schedule="constant")
    tx = make_optimizer(c, 10, params)
    state = tx.init(params)
    new = params
    for i in range(3):
        updates, state = tx.update(grads_like(params, i), state, new)
        new = optax.apply_updates(new, updates)
    labels = dict(nnx.to_flat_state(trainable_labels(params, r"mlp\.")))
    for path, before in nnx.to_flat_state(params):
        after = dict(nnx.to_flat_state(new))[path]
        same = np.array_equal(np.asarray(before[...]), np.asarray(after[...]))
        assert same == (labels[path] == "frozen"), path
    # frozen parameters carry no optimizer moments
    n_state = sum(x.size for x in jax.tree.leaves(state))
    n_trainable = sum(int(np.prod(v.shape)) for p, v in nnx.to_flat_state(params) if labels[p] == "train")
    assert n_state < 3 * n_trainable  # mu + nu (+ counters) for trainable params only


def test_trainable_regex_matching_nothing():
    _, params = tiny_params()
    with pytest.raises(ValueError, match="matches no parameter"):
        trainable_labels(params, "nothing_like_this")


@pytest.mark.parametrize("name", ["sgd", "muon"])
def test_other_optimizers_step(name):
    _, params = tiny_params()
    tx = make_optimizer(OptimConfig(name=name, learning_rate=0.01, schedule="constant"), 10, params)
    updates, _ = jax.jit(tx.update)(grads_like(params), tx.init(params), params)
    assert all(np.isfinite(np.asarray(u)).all() and np.asarray(u).any() for u in jax.tree.leaves(updates))


def test_trainable_regex_reads_the_paths_of_a_module_tree():
    """In a method's module tree (a model and a feature projection trained with it) `trainable_regex` matches each
    parameter's path in the tree: `mlp\\.|projections` trains the model's MLPs and the projection with AdamW, and
    the rest of the model does not move; one clip covers the whole tree."""
    from posttrain.distill.features import feature_projections
    from posttrain.distill.objective import DistillModules, trainable

    model, _ = tiny_params()
    tree = DistillModules(model, feature_projections([(1, 1)], 64, 32, seed=0))
    params = nnx.state(tree, trainable(nnx.Param))
    c = OptimConfig(name="adamw", learning_rate=0.1, trainable_regex=r"mlp\.|projections", schedule="constant")
    tx = make_optimizer(c, 10, params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    kernel = np.asarray(params["projections"]["kernels"][0][...])
    # AdamW's first step moves every entry by lr (sign of the gradient) plus the decay
    moved = np.asarray(new["projections"]["kernels"][0][...]) - kernel
    np.testing.assert_allclose(moved, -0.1 - 0.1 * c.weight_decay * kernel, rtol=1e-4, atol=1e-6)
    frozen = np.asarray(params["model"]["embed"]["embedding"][...])
    np.testing.assert_array_equal(np.asarray(new["model"]["embed"]["embedding"][...]), frozen)
    trained = [p for p, _ in nnx.to_flat_state(params) if "mlp" in ".".join(map(str, p))]
    before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(new))
    assert trained and all(not np.array_equal(before[p][...], after[p][...]) for p in trained)

    # One clip at optim.grad_clip_norm over every trainable parameter (SGD shows it: AdamW's first step does not
    # depend on the scale).
    sgd = OptimConfig(name="sgd", learning_rate=0.1, schedule="constant", grad_clip_norm=1.0)
    tx = make_optimizer(sgd, 10, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    norm = np.sqrt(sum(x.size for x in jax.tree.leaves(params)))  # of the all-ones gradient of the whole tree
    np.testing.assert_allclose(np.asarray(updates["projections"]["kernels"][0]), -0.1 / norm, rtol=1e-5)
