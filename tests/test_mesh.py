import jax
import pytest
from jax.sharding import PartitionSpec as P

from core.config import MeshConfig
from core.mesh import LOGICAL_RULES, logical_to_spec, make_mesh, split_devices


def test_make_mesh_fills_axis():
    mesh = make_mesh(MeshConfig(fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2, "sequence": 1}


def test_logical_rules_map_parameters_and_activations():
    assert logical_to_spec(("embed", "mlp")) == P(("fsdp", "expert"), "tensor")
    assert logical_to_spec(("batch", "length", "act_embed")) == P(("data", "fsdp", "expert"), "sequence", None)
    assert logical_to_spec(("layers", "embed", "heads", "head_dim")) == P(None, ("fsdp", "expert"), "tensor", None)
    # a mixture of experts' stacked experts: the expert axis splits the experts, fsdp their embed dimension
    assert logical_to_spec(("experts", "embed", "mlp")) == P("expert", "fsdp", "tensor")


def test_indivisible_dims_replicate_and_axes_not_reused():
    shape = {"data": 1, "fsdp": 4, "tensor": 2, "sequence": 1}
    assert logical_to_spec(("embed", "mlp"), (6, 8), shape) == P(None, "tensor")
    # size-1 mesh axes are dropped; `batch` uses fsdp, so it cannot be used twice
    assert logical_to_spec(("batch", "embed"), (8, 8), shape) == P("fsdp", None)


def test_unknown_logical_axis():
    with pytest.raises(KeyError, match="unknown logical axis"):
        logical_to_spec(("embedding",))
    assert "vocab" in LOGICAL_RULES


def test_split_devices():
    devs = jax.devices()
    assert len(devs) == 8
    trainer, sampler = split_devices(devs, 0.5, 0.5)
    assert trainer == devs[:4] and sampler == devs[4:]
    trainer, sampler = split_devices(devs, 0.75, 0.25)
    assert len(trainer) == 6 and len(sampler) == 2 and not set(trainer) & set(sampler)
    t1, s1 = split_devices(devs[:1], 1.0, 0.0)
    assert t1 == devs[:1] and s1 == []


def test_split_devices_errors():
    devs = jax.devices()
    with pytest.raises(ValueError, match="> 1"):
        split_devices(devs, 0.8, 0.4)
    with pytest.raises(ValueError, match="out of 1"):
        split_devices(devs[:1], 0.5, 0.5)
    with pytest.raises(ValueError, match="leaves the trainer no device"):
        split_devices(devs, 0.0, 0.5)
