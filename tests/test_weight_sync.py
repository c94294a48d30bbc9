"""Chunked weight sync: planning, JAX -> JAX resharding across sub-meshes, JAX -> the pieces a vLLM sampler puts
together."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from core.config import MeshConfig
from core.hf.directory import load_hf
from core.hf.pieces import TensorAssembler, TensorPiece, WeightUpdateError, local_pieces
from core.mesh import make_mesh
from rollout.jax_sampler import JaxSampler
from rollout.sampler import SamplingParams
from rollout.weight_sync import piece_chunks, plan_chunks, reshard_to_jax_sampler


def test_plan_chunks():
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]
    assert plan_chunks(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_chunks(sizes, 1000, max_tensors=2) == [["a", "b"], ["c", "d"], ["e"]]


def test_reshard_between_sub_meshes_is_exact_and_bounded(rollout_model_dir):
    devices = jax.devices()
    trainer_mesh = make_mesh(MeshConfig(fsdp=4), devices[:4])
    sampler_mesh = make_mesh(MeshConfig(fsdp=1, tensor=4), devices[4:])
    trained, _ = load_hf(rollout_model_dir("llama", seed=1), mesh=trainer_mesh)
    start, _ = load_hf(rollout_model_dir("llama", seed=0), mesh=sampler_mesh)
    sampler = JaxSampler(start, str(rollout_model_dir("llama")), mesh=sampler_mesh, max_model_len=128)

    params = nnx.state(trained)
    sizes = [v.get_value().nbytes for _, v in nnx.to_flat_state(params)]
    chunk = 128 * 1024
    stats = reshard_to_jax_sampler(params, sampler, chunk_bytes=chunk, measure_memory=True)
    assert stats.version == 1 == sampler.policy_version and stats.bytes == sum(sizes) and stats.chunks > 4
    print(
        f"peak extra memory {stats.peak_extra_bytes} B, chunk {chunk} B, largest tensor {max(sizes)} B, "
        f"all parameters {sum(sizes)} B"
    )
    assert stats.peak_extra_bytes <= chunk + max(sizes)
    assert stats.peak_extra_bytes < sum(sizes) / 2

    for (path, a), (_, b) in zip(nnx.to_flat_state(params), nnx.to_flat_state(sampler.params)):
        assert set(b.get_value().sharding.device_set) <= set(devices[4:]), path
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
    q = sampler.params["layers"]["attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding.spec[2] == "tensor"  # the sampler's own layout, not the trainer's

    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    fresh_model, _ = load_hf(rollout_model_dir("llama", seed=1))
    fresh = JaxSampler(fresh_model, str(rollout_model_dir("llama")), max_model_len=128)
    prompts = [[5, 17, 99, 3], [42]]
    assert [c.token_ids for c in sampler.generate(prompts, greedy)] == [
        c.token_ids for c in fresh.generate(prompts, greedy)
    ]


def test_reshard_refuses_a_different_model(rollout_model_dir):
    a, _ = load_hf(rollout_model_dir("llama"))
    b, _ = load_hf(rollout_model_dir("llama"), scan_layers=False)
    sampler = JaxSampler(a, str(rollout_model_dir("llama")), max_model_len=128)
    with pytest.raises(ValueError, match="nothing copied"):
        reshard_to_jax_sampler(nnx.state(b), sampler, chunk_bytes=1 << 20)
    assert sampler.policy_version == 0


def source_tensors(hf_dir) -> dict[str, np.ndarray]:
    """The tensors `transformers` wrote to the model directory: what the synced pieces must make, name for name."""
    from safetensors.numpy import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def assembled(cfg, chunks, bound: int | None = None) -> dict[str, np.ndarray]:
    """What a sampler makes of the chunks: every tensor put together from its pieces and laid out as Hugging Face
    keeps it (raises unless every element arrived once). Each chunk is within `bound` unless it is one piece."""
    assembler = TensorAssembler(cfg)
    for chunk in chunks:
        if bound is not None:
            assert len(chunk) == 1 or sum(p.data.nbytes for p in chunk) <= bound, [p.name for p in chunk]
        assembler.add(chunk, tag="t")
    assembler.check("t")
    return dict(assembler.hf_tensors())


def assert_makes_the_source(got: dict[str, np.ndarray], source: dict[str, np.ndarray]) -> None:
    assert set(got) == set(source), set(got) ^ set(source)
    for name, value in got.items():
        np.testing.assert_array_equal(value, source[name], err_msg=name)
        assert value.flags["C_CONTIGUOUS"], name


@pytest.mark.parametrize("scan", [True, False])
def test_pieces_of_a_sharded_model_make_the_checkpoints_tensors_once_within_the_bound(rollout_model_dir, scan):
    """The pieces of a model loaded from a Hugging Face directory (sharded on a 2 x 2 mesh, stacked layers or not),
    one replica of each shard, put back together, are exactly the tensors `transformers` saved there, bitwise;
    no chunk is above the bound by more than one piece, and nothing is sent twice: the pieces hold each element
    of the model once."""
    hf_dir = rollout_model_dir("qwen2", tied=True)
    model, cfg = load_hf(hf_dir, mesh=make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4]), scan_layers=scan)
    source = source_tensors(hf_dir)
    chunks = list(piece_chunks(nnx.state(model), cfg, chunk_bytes=50_000))
    assert len(chunks) > 4  # the bound really cut the weights into several chunks
    pieces = [p for chunk in chunks for p in chunk]
    assert len(pieces) > len(source)  # sharded tensors travel in several pieces
    assert sum(p.data.size for p in pieces) == sum(v.size for v in source.values())
    assert_makes_the_source(assembled(cfg, chunks, 50_000), source)


def test_the_assembler_refuses_pieces_that_do_not_make_the_model(rollout_model_dir):
    """A missing piece, a piece sent twice, a piece in place of another (the right size in all, one block
    covered twice and one not at all), a piece outside its tensor and a tensor the model does not have are each
    refused, naming the tensor; pieces of a new update start the buffers over."""
    model, cfg = load_hf(rollout_model_dir("llama"), mesh=make_mesh(MeshConfig(fsdp=2), jax.devices()[:2]))
    pieces = list(local_pieces(nnx.state(model), cfg))
    name = "model.layers.1.mlp.up_proj.weight"
    split = [p for p in pieces if p.name == name]
    assert len(split) == 2  # fsdp=2: two halves

    def check(chunk, tag="t"):
        assembler = TensorAssembler(cfg)
        assembler.add(chunk, tag)
        assembler.check(tag)

    half, shape = split[0].data.size, split[0].data.shape
    with pytest.raises(WeightUpdateError, match=f"{name}: {half} of {2 * half} elements received"):
        check([p for p in pieces if p is not split[0]])
    with pytest.raises(
        WeightUpdateError, match=f"{name}: the block at {re.escape(str(split[0].start))} .* overlaps one received"
    ):
        check([*pieces, split[0]])
    twice = TensorPiece(name, split[0].start, split[1].data)  # the second half's values over the first half
    with pytest.raises(
        WeightUpdateError, match=f"{name}: the block at {re.escape(str(split[0].start))} .* overlaps one received"
    ):
        check([p for p in pieces if p is not split[1]] + [twice])
    moved = TensorPiece(name, (1, 1), split[0].data)  # one row and column off: past the tensor's end
    with pytest.raises(WeightUpdateError, match=rf"{name}: a block of shape \({shape[0]}, {shape[1]}\) at \(1, 1\)"):
        check([*pieces, moved])
    with pytest.raises(WeightUpdateError, match="unexpected tensor model.layers.9.mlp.up_proj.weight"):
        check([*pieces, TensorPiece("model.layers.9.mlp.up_proj.weight", (0, 0), split[0].data)])
    assembler = TensorAssembler(cfg)
    assembler.add(pieces[:3], tag="old")
    assembler.add(pieces, tag="new")  # the old update's pieces do not count twice
    assembler.check("new")
    with pytest.raises(WeightUpdateError, match="no piece of this update arrived"):
        assembler.check("new")  # a check ends the update


@pytest.mark.gpu_only
def test_gpu_sync_path_sends_the_checkpoints_tensors(rollout_model_dir):
    """On a GPU machine the pieces come from device memory: they must make what `transformers` saved, bitwise."""
    hf_dir = rollout_model_dir("llama")
    model, cfg = load_hf(hf_dir)
    assert next(iter(jax.tree.leaves(nnx.state(model)))).devices().pop().platform == "gpu"
    got = assembled(cfg, piece_chunks(nnx.state(model), cfg, chunk_bytes=1 << 20))
    assert_makes_the_source(got, source_tensors(hf_dir))


def test_syncing_twice_to_a_sampler_on_the_trainers_mesh_leaves_the_trainer_alive(rollout_model_dir):
    """Trainer and JAX sampler on one mesh (single controller, sampler fraction 0): the sync copies. Before,
    `device_put` onto the same sharding handed the sampler the trainer's own buffers: a second sync then
    deleted them as "the sampler's old copy", and the trainer's next (donating) step found them gone."""
    from core.config import OptimConfig
    from core.data import to_data_batch
    from core.losses import nll_loss
    from core.optim import make_optimizer
    from core.train import split_micro_batches
    from tests.helpers import jitted_step

    path = rollout_model_dir("llama")
    mesh = make_mesh(MeshConfig(fsdp=2), jax.devices()[:2])
    with jax.set_mesh(mesh):
        model, _ = load_hf(path, mesh=mesh)
        placeholder, _ = load_hf(rollout_model_dir("llama", seed=1), mesh=mesh)
        sampler = JaxSampler(placeholder, str(path), mesh=mesh, max_model_len=128)
        sgd = OptimConfig(name="sgd", learning_rate=0.1, schedule="constant")
        step, state, rest = jitted_step(model, nll_loss, make_optimizer(sgd, 10, nnx.state(model)))
        reshard_to_jax_sampler(state.params, sampler, chunk_bytes=1 << 20)
        reshard_to_jax_sampler(state.params, sampler, chunk_bytes=1 << 20)
        before = jax.tree.map(np.asarray, state.params)
        tokens = np.random.default_rng(0).integers(3, 500, (2, 16)).astype(np.int32)
        rows = {
            "tokens": tokens,
            "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
            "segment_ids": np.ones((2, 16), np.int32),
            "loss_mask": np.ones((2, 16), np.int32),
            "example_ids": np.zeros((2, 16), np.int32),
        }
        batch = to_data_batch(rows, 1).batch
        state, update = step(state, split_micro_batches(batch, 1), rest)  # donates the trainer's buffers
        assert np.isfinite(float(update.loss))
        greedy = SamplingParams(temperature=0.0, max_tokens=6)
        got = sampler.generate([[5, 17, 99, 3]], greedy)  # the sampler still holds the pre-step weights
    fresh_model, _ = load_hf(path)
    want = JaxSampler(fresh_model, str(path), max_model_len=128).generate([[5, 17, 99, 3]], greedy)
    assert got[0].token_ids == want[0].token_ids
    assert any(
        not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))
    )  # the trainer trained
    reshard_to_jax_sampler(state.params, sampler, chunk_bytes=1 << 20)  # and syncs again
