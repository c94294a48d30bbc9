"""`PackedBatch.compact`: the decoder layers on the real tokens only, the same hidden states and gradients as on
the rows (`core.models.compact`), per data shard on a mesh, and the counts `core.batch.with_compact` sets."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import core.batch
from core.batch import with_compact
from core.config import MeshConfig, ModelConfig
from core.losses import nll_loss
from core.mesh import make_mesh
from core.models import create_model
from core.models.compact import Compaction
from core.train import place_batch, split_micro_batches
from tests.helpers import assert_same_gradients
from tests.test_train_step import make_batch, packed


def with_branches(batch):
    """The batch with its second segments split into two branches after their first 3 tokens (the layout of a
    shared prompt with two continuations), so the mask is not plain causal."""
    seg = np.asarray(batch.segment_ids)
    branch = np.zeros_like(seg)
    for r in range(seg.shape[0]):
        second = np.flatnonzero(seg[r] == 2)
        if len(second) >= 5:
            rest = second[3:]
            branch[r, rest[: len(rest) // 2]], branch[r, rest[len(rest) // 2 :]] = 1, 2
    return dataclasses.replace(batch, branch_ids=branch)


@pytest.mark.parametrize("scan", [True, False])
def test_hidden_states_on_real_tokens_equal_the_rows(scan):
    cfg = ModelConfig(family="qwen2", attention_bias=True, scan_layers=scan)
    model = create_model(cfg, None, seed=0)
    batch = with_branches(packed(make_batch(rows=8, t=24)))
    real = np.asarray(batch.segment_ids) > 0
    count = int(real.sum())
    assert count < real.size and Compaction.of(batch.segment_ids, count + 5) is not None  # compaction happens
    args = (batch.tokens, batch.positions, batch.segment_ids, batch.branch_ids)
    rows = np.asarray(model.hidden_states(*args))
    compact = np.asarray(model.hidden_states(*args, compact=count + 5))  # 5 fill entries past the real tokens
    scale = float(np.abs(rows[real]).max())
    np.testing.assert_allclose(compact[real], rows[real], rtol=0, atol=8 * float(np.spacing(np.float32(scale))))
    assert not compact[~real].any()  # padding positions read zeros
    assert rows[~real].any()  # (on the rows they hold the padding tokens' states)
    # An intermediate layer's states (feature distillation's input) go back to the rows the same way.
    (row_layer,) = model.layer_states(*args, layers=(1,))[1]
    (compact_layer,) = model.layer_states(*args, compact=count + 5, layers=(1,))[1]
    row_layer, compact_layer = np.asarray(row_layer), np.asarray(compact_layer)
    scale = float(np.abs(row_layer[real]).max())
    tol = 8 * float(np.spacing(np.float32(scale)))
    np.testing.assert_allclose(compact_layer[real], row_layer[real], rtol=0, atol=tol)
    assert not compact_layer[~real].any() and np.abs(row_layer - rows).max() > 1e-3  # not the final states


def grads(graphdef, params, batch):
    return jax.grad(lambda p: nll_loss(nnx.merge(graphdef, p), batch, jax.random.key(0)).total)(params)


def test_gradients_on_real_tokens_equal_the_rows(monkeypatch):
    cfg = ModelConfig(family="qwen2", attention_bias=True)
    graphdef, params = nnx.split(create_model(cfg, None, seed=0))
    batch = with_branches(packed(make_batch(rows=8, t=24)))
    monkeypatch.setattr(core.batch, "COMPACT_MIN_SLOTS", 0)
    counted = split_micro_batches(batch, 1)
    assert 0 < counted.compact < batch.tokens.size  # the counts reach the compact layout
    one = lambda b: jax.tree.map(lambda x: x[0], b)
    rows = grads(graphdef, params, one(dataclasses.replace(counted, compact=0)))
    assert_same_gradients(grads(graphdef, params, one(counted)), rows)


def test_each_data_shard_compacts_its_own_rows(monkeypatch):
    """On a mesh whose data axes split the rows, each shard's rows are compacted apart (no token crosses a
    device) and the gradients equal one device's without compaction."""
    cfg = ModelConfig(family="qwen2", attention_bias=True)
    graphdef, params = nnx.split(create_model(cfg, None, seed=0))
    batch = with_branches(packed(make_batch(rows=8, t=24)))
    single = grads(graphdef, params, batch)

    monkeypatch.setattr(core.batch, "COMPACT_MIN_SLOTS", 0)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    placed = jax.tree.map(lambda x: x[0], place_batch(split_micro_batches(batch, 1, mesh), mesh))
    real = (np.asarray(batch.segment_ids) > 0).reshape(4, -1).sum(axis=1)  # 4 data shards of 2 rows
    assert real.max() <= placed.compact < 2 * 24
    sharded_graphdef, sharded_params = nnx.split(create_model(cfg, mesh, seed=0))
    with jax.set_mesh(mesh):
        assert Compaction.of(placed.segment_ids, placed.compact).take.shape == (4, placed.compact)
        sharded = jax.jit(lambda p, b: grads(sharded_graphdef, p, b))(sharded_params, placed)
    assert_same_gradients(jax.device_get(sharded), single)


def test_compact_counts():
    seg = np.zeros((8, 256), np.int32)
    for r, n in enumerate([256, 100, 30, 200, 250, 256, 10, 90]):
        seg[r, :n] = 1
    batch = packed(make_batch())  # any batch; its arrays replaced below
    batch = dataclasses.replace(batch, segment_ids=seg, tokens=seg, positions=seg, branch_ids=seg * 0)
    # one part of 8 rows: 1,192 real of 2,048, rounded up to eighths (256)
    assert with_compact(dataclasses.replace(batch, groups=1)).compact == 1280
    # two micro-batches of 4 rows: the fuller (rows 4-7: 606 real) of 1,024 positions, in steps of 128
    assert with_compact(dataclasses.replace(batch, groups=2)).compact == 640
    # one micro-batch on 2 data shards: the same parts
    assert with_compact(dataclasses.replace(batch, groups=1), {"data": 2}).compact == 640
    # two micro-batches on 2 data shards: parts of 2 rows (512 positions) are below COMPACT_MIN_SLOTS
    assert with_compact(dataclasses.replace(batch, groups=2), {"data": 2}).compact == 0
    # more than 7/8 of the positions real: rounding up leaves no gain
    nearly = seg.copy()
    nearly[:, :240] = 1
    assert with_compact(dataclasses.replace(batch, segment_ids=nearly, groups=1)).compact == 0
