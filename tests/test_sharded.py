"""8 fake CPU devices, mesh fsdp=4 x tensor=2: forward and gradients equal the single-device run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from core.config import MeshConfig
from core.hf.directory import load_hf
from core.mesh import make_mesh


def loss_and_grads(model, tokens, mesh=None):
    graphdef, state = nnx.split(model)

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean(), logits

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    if mesh is None:
        return step(state)
    with jax.set_mesh(mesh):
        return step(state)


@pytest.mark.parametrize("scan", [True, False])
def test_fsdp_tensor_equals_single_device(tiny_hf_dir, scan):
    path = tiny_hf_dir("qwen2")
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    sharded, _ = load_hf(path, mesh=mesh, scan_layers=scan)
    single, _ = load_hf(path, scan_layers=scan)

    q = sharded.layers.attn.q_proj.kernel if scan else sharded.layers[0].attn.q_proj.kernel
    spec = q[...].sharding.spec
    assert spec == (P(None, "fsdp", "tensor", None) if scan else P("fsdp", "tensor", None))
    assert len(q[...].sharding.device_set) == 8

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (8, 32)), jnp.int32)
    (loss_s, logits_s), grads_s = loss_and_grads(sharded, tokens, mesh)
    (loss_1, logits_1), grads_1 = loss_and_grads(single, tokens)

    assert abs(float(loss_s) - float(loss_1)) <= 1e-5
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_1), atol=1e-5)
    flat_s, flat_1 = dict(nnx.to_flat_state(grads_s)), dict(nnx.to_flat_state(grads_1))
    assert flat_s.keys() == flat_1.keys()
    for key in flat_1:
        np.testing.assert_allclose(
            np.asarray(flat_s[key][...]), np.asarray(flat_1[key][...]), atol=1e-5, err_msg=str(key)
        )
