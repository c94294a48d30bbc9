"""Small helpers several test modules share."""

from __future__ import annotations

import jax
import numpy as np
import optax


def jitted_step(model, loss_fn, tx, trainable=None):
    """(the jitted `core.train` step, its initial state, the frozen rest) of `model` (or a module tree) trained by
    `tx` on `loss_fn`: `state, update = step(state, split_micro_batches(batch, k), rest)`."""
    from flax import nnx

    from core.train import init_train_state, jit_train_step, make_train_step, split_modules

    graphdef, params, rest = split_modules(model, nnx.Param if trainable is None else trainable)
    state = init_train_state(params, tx, seed=0)
    return jit_train_step(make_train_step(graphdef, loss_fn, tx), state), state, rest


def saved_tensors(step_dir) -> list[str]:
    """The dotted paths of the tensors a checkpoint step's `params` item holds (read from Orbax's metadata)."""
    import ast
    import json
    from pathlib import Path

    tree = json.loads((Path(step_dir) / "params" / "_METADATA").read_text())["tree_metadata"]
    return sorted(".".join(map(str, ast.literal_eval(key))) for key in tree)


def recording_sgd(learning_rate: float):
    """SGD whose state is the last gradient it was given, so a test can read every update's gradient."""

    def update(grads, state, params=None):
        return jax.tree.map(lambda g: -learning_rate * g, grads), grads

    return optax.GradientTransformation(lambda params: jax.tree.map(jax.numpy.zeros_like, params), update)


def assert_same_gradients(a, b, steps: float = 32.0) -> None:
    """Two gradient pytrees equal tensor by tensor, each to within `steps` float32 steps (ulps) of that tensor's
    own largest entry (a small tensor is held to its own scale, not to the largest gradient anywhere); and not
    zero: an equivalence of two steps that did nothing proves nothing."""
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b, "the two gradients have different structures"
    largest = 0.0
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape, (jax.tree_util.keystr(path), x.shape, y.shape)
        scale = max(float(np.abs(x).max(initial=0.0)), float(np.finfo(np.float32).tiny))
        largest = max(largest, float(np.abs(x).max(initial=0.0)))
        diff = float(np.abs(x - y).max(initial=0.0))
        tol = steps * float(np.spacing(np.float32(scale)))
        assert diff <= tol, f"{jax.tree_util.keystr(path)} {x.shape}: |diff| {diff:.3g} > {steps:g} ulps ({tol:.3g})"
    assert largest > 0.0, "every gradient is zero: the steps compared did not train"


def pipeline(
    records,
    cfg,
    batch_size: int,
    tokenizer_dir: str,
    *,
    split: str = "train",
    micro_batches: int = 1,
    row_multiple: int = 1,
    completion_only: bool = True,
):
    """`core.data.make_pipeline` over `records`, read by the row format of `cfg.format` (pretraining's text, SFT's
    prompt / completion or chat rows)."""
    from core.data import TextRows, load_tokenizer, make_pipeline, tokenize_examples
    from posttrain.sft import row_format

    rows = TextRows() if cfg.format == "text" else row_format(cfg.format, completion_only)
    examples = tokenize_examples(records, rows, load_tokenizer(tokenizer_dir), cfg)
    return make_pipeline(examples, cfg, batch_size, split=split, micro_batches=micro_batches, row_multiple=row_multiple)


def next_loss_batch(run):
    """The next batch of a built dataset run (`core.run.build_run`) as the method's loss reads it: the source's
    item, prepared, with what the method attaches (a live reference's log-probs)."""
    loop = run.loop
    return loop.trainer.learner.attach(loop.source.next().batch)[0]


def with_router_stats(fn, model):
    """(`fn(model)`, the `RouterStats` `model` sowed in it, pooled over its passes; None for a dense model)."""
    from core.router_loss import capture_router, sown_at

    out, sown = capture_router(fn)(model)
    return out, sown_at(sown)


def method_learner(config: str, method, *overrides: str):
    """(`core.method_learner.MethodLearner` of `method` on a fresh model of `config` with `overrides`, on one
    device; the config)."""
    from core.config_loader import load_config
    from core.mesh import single_device_mesh
    from core.method_learner import MethodLearner
    from core.models import create_model
    from posttrain.config import PostTrainConfig

    cfg = load_config(config, list(overrides), schema=PostTrainConfig)
    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model = create_model(cfg.model, mesh, seed=0)
    return MethodLearner(cfg, method, model, mesh), cfg


def step_metrics(cfg, method, on_ray: bool = False) -> list[dict]:
    """Each step's metrics of a sampler run of `cfg` with `method`, the run closed after; `on_ray`: a local Ray
    cluster started before it (the vLLM sampler) and shut down after."""
    from posttrain.onpolicy.run import build_sampler_run

    if on_ray:
        from rollout.ray import ensure_ray

        ensure_ray(num_cpus=2)
    seen: list[dict] = []
    try:
        run = build_sampler_run(cfg, method)
        try:
            run.train(on_step=lambda r, step, m: seen.append(m))
        finally:
            run.close()
    finally:
        if on_ray:
            import ray

            ray.shutdown()
    return seen
