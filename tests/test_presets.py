"""Full-size presets build abstractly; parameter counts; summary; remat and scan variants agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import MeshConfig
from core.config_loader import list_presets, load_config
from core.mesh import make_mesh
from core.models import abstract_model, create_model, param_count
from core.models.decoder import REMAT_POLICIES
from core.models.summary import parameter_summary


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_builds_abstractly(preset):
    cfg = load_config(overrides=[f"model.preset={preset}"]).model
    model = abstract_model(cfg)
    leaves = jax.tree.leaves(nnx.state(model))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


@pytest.mark.parametrize(
    "preset,count",
    [
        ("llama3.1-8b", 8_030_261_248),
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen3-0.6b", 596_049_920),
        ("mistral-7b", 7_248_023_552),
        ("qwen3-30b-a3b", 30_532_122_624),  # transformers' Qwen3MoeForCausalLM of that config, on the meta device
    ],
)
def test_parameter_counts(preset, count):
    cfg = load_config(overrides=[f"model.preset={preset}"]).model
    assert param_count(abstract_model(cfg)) == count


def test_every_parameter_has_logical_axes():
    for scan in (True, False):
        model = abstract_model(load_config(overrides=["model.preset=tiny-qwen3", f"model.scan_layers={scan}"]).model)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            axes = var.get_metadata("logical_axes")
            assert len(axes) == len(var.shape), path
            assert (axes[0] == "layers") == (scan and path[0] == "layers"), path


def test_summary_plans_sharding_for_8b_on_a_mesh():
    cfg = load_config(overrides=["model.preset=llama3.1-8b"]).model
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    text = parameter_summary(abstract_model(cfg), mesh)
    assert "total: 8,030,261,248 parameters" in text
    line = next(l for l in text.splitlines() if l.startswith("layers.attn.q_proj.kernel"))
    assert "(32, 4096, 32, 128)" in line and "('layers', 'embed', 'heads', 'head_dim')" in line
    assert "P(None, 'fsdp', 'tensor', None)" in line


@pytest.mark.parametrize(
    "policy,scan",
    [
        ("full", True),
        ("full", False),
        ("dots_saveable", True),
        ("dots_with_no_batch_dims_saveable", False),
    ],
)
def test_remat_policies_do_not_change_values_or_gradients(policy, scan):
    """Each policy is applied (the layers run under a `remat` with that policy: the differentiated program holds
    one, the one without a policy none) and changes neither the value nor the gradient."""
    base = load_config(overrides=["model.preset=tiny-llama", f"model.scan_layers={scan}"]).model
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 16)), jnp.int32)

    def grads(cfg):
        graphdef, state = nnx.split(create_model(cfg, seed=1))
        f = jax.value_and_grad(lambda s: nnx.merge(graphdef, s)(tokens).astype(jnp.float32).mean())
        return jax.jit(f)(state), remat_policies(jax.make_jaxpr(f)(state).jaxpr)

    remat = base.model_copy(update={"remat_policy": policy})
    ((v0, g0), none), ((v1, g1), applied) = grads(base), grads(remat)
    assert not none and applied and set(applied) == {REMAT_POLICIES[policy]}, (none, applied)
    assert float(v0) == pytest.approx(float(v1), abs=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert max(float(np.abs(np.asarray(a)).max()) for a in jax.tree.leaves(g0)) > 0


def remat_policies(jaxpr) -> list:
    """The policy of every `remat` in a jaxpr, sub-programs (scan bodies, jit calls) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("remat2", "checkpoint", "remat"):
            found.append(eqn.params["policy"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += remat_policies(inner)
    return found
