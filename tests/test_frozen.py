"""Frozen models: a copy of the learner's start, or read from any checkpoint with its own shape (a teacher)."""

from __future__ import annotations

import numpy as np

from core.mesh import make_mesh


def test_a_frozen_model_loads_with_its_own_shape_and_scores_like_transformers(tiny_hf_dir, tmp_path):
    """A model of another family and width than the learner, read from its HF directory onto the learner's mesh
    (4 fsdp shards): its log-probs of a packed batch's targets equal transformers' on each sequence alone."""
    import torch
    import transformers

    from core.config import MeshConfig
    from posttrain.dpo.pairs import Pair, build_pair_batch
    from posttrain.frozen import FrozenModel

    path = tiny_hf_dir("qwen3")
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    teacher = FrozenModel.load(str(path), mesh, "teacher")
    assert teacher.cfg is not None and teacher.cfg.family == "qwen3" and teacher.cfg.qk_norm
    rng = np.random.default_rng(0)
    ids = lambda n: tuple(int(x) for x in rng.integers(1, teacher.cfg.vocab_size, n))
    pairs = [Pair(i, ids(5 + i), ids(4), ids(6)) for i in range(4)]
    batch = build_pair_batch(pairs, slots=4, row_len=64, row_multiple=2)
    logp = teacher.logprobs(batch.packed)  # [8, C]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, pair in enumerate(pairs):
        for side, completion in ((0, pair.chosen), (1, pair.rejected)):
            seq = torch.tensor([list(pair.prompt) + list(completion)])
            with torch.no_grad():
                ref = torch.log_softmax(hf(seq).logits[0].double(), -1).numpy()
            want = np.array([ref[len(pair.prompt) - 1 + j, t] for j, t in enumerate(completion)])
            got = logp[2 * i + side, : len(completion)]
            np.testing.assert_array_less(np.abs(got - want), 64 * np.spacing(np.abs(want).astype(np.float32)))
