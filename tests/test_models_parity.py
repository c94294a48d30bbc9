"""Core models against Hugging Face transformers on the same random weights (float32)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.hf.directory import load_hf
from core.tiny import FAMILIES

TOL = 1e-4


def hf_logits(path, tokens, attention_mask=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        mask = None if attention_mask is None else torch.tensor(attention_mask)
        return model(torch.tensor(tokens), attention_mask=mask).logits.numpy()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layers", ["scan, unrolled", "scan, rolled", "loop"])
def test_logits_match_transformers(tiny_hf_dir, family, tied, layers):
    path = tiny_hf_dir(family, tied)
    tokens = np.random.RandomState(1).randint(0, 512, (2, 48))  # longer than llama3 original ctx 32
    ref = hf_logits(path, tokens)
    scan = layers != "loop"
    model, cfg = load_hf(path, scan_layers=scan, scan_unroll=layers != "scan, rolled")
    assert cfg.tie_word_embeddings == tied and cfg.scan_layers == scan
    out = np.asarray(model(tokens.astype(np.int32)))
    assert out.dtype == np.float32 and out.shape == (2, 48, 512)
    assert np.abs(out - ref).max() <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_right_padding_matches_transformers(tiny_hf_dir, family):
    path = tiny_hf_dir(family)
    tokens = np.random.RandomState(2).randint(3, 512, (3, 20))
    lengths = [20, 13, 7]
    mask = np.array([[1] * n + [0] * (20 - n) for n in lengths])
    tokens = np.where(mask == 1, tokens, 0)
    ref = hf_logits(path, tokens, mask)
    model, _ = load_hf(path)
    out = np.asarray(model(tokens.astype(np.int32), segment_ids=mask.astype(np.int32)))
    for row, n in enumerate(lengths):
        assert np.abs(out[row, :n] - ref[row, :n]).max() <= TOL


def test_packed_sequences_equal_separate_runs(tiny_hf_dir):
    """Two documents packed in one row (segment_ids + restarting positions) == each run alone."""
    model, _ = load_hf(tiny_hf_dir("qwen2"))
    rng = np.random.RandomState(3)
    a, b = rng.randint(0, 512, 11), rng.randint(0, 512, 9)
    packed = np.concatenate([a, b])[None].astype(np.int32)
    segments = np.array([[1] * 11 + [2] * 9], np.int32)
    positions = np.array([list(range(11)) + list(range(9))], np.int32)
    out = np.asarray(model(packed, positions=positions, segment_ids=segments))
    alone_a = np.asarray(model(a[None].astype(np.int32)))
    alone_b = np.asarray(model(b[None].astype(np.int32)))
    assert np.abs(out[0, :11] - alone_a[0]).max() <= 1e-5
    assert np.abs(out[0, 11:] - alone_b[0]).max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_compute_is_as_close_to_float32_as_transformers_in_bfloat16(tiny_hf_dir, family):
    """Errors in units of the bfloat16 step at the logits' magnitude (2^-7 of the largest power of two below
    max |logit|): measured ~4 steps at most and ~0.5 on average, as transformers' own bf16 forward pass."""
    path = tiny_hf_dir(family)
    tokens = np.random.RandomState(4).randint(0, 512, (2, 16)).astype(np.int32)
    f32, _ = load_hf(path)
    bf16, cfg = load_hf(path, dtype="bfloat16")
    out = np.asarray(bf16(tokens))
    assert out.dtype == np.float32 and cfg.param_dtype == "bfloat16"
    ref = np.asarray(f32(tokens), np.float64)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    step = 2.0 ** (np.floor(np.log2(np.abs(ref).max())) - 7)
    ours_err, hf_err = np.abs(out - ref) / step, np.abs(theirs - ref) / step
    assert ours_err.max() <= 8 and ours_err.mean() <= 1.0, (ours_err.max(), ours_err.mean())
    assert ours_err.max() <= 1.5 * hf_err.max() + 1 and ours_err.mean() <= 1.5 * hf_err.mean() + 0.1


def test_mistral_sliding_window_matches_transformers(tmp_path):
    from core.tiny import save_tiny_hf_model

    path = save_tiny_hf_model(tmp_path / "mistral_sw", "mistral", sliding_window=8)
    tokens = np.random.RandomState(5).randint(0, 512, (2, 30))
    ref = hf_logits(path, tokens)
    model, cfg = load_hf(path)
    assert cfg.sliding_window == 8
    assert np.abs(np.asarray(model(tokens.astype(np.int32))) - ref).max() <= TOL


@pytest.mark.parametrize("family,window", [("qwen2", None), ("mistral", 8)])
def test_completions_sharing_a_prompt_match_transformers(tmp_path, family, window):
    """One prompt and three completions in one segment (branch 0 = prompt, branch k = completion k, positions
    continuing the prompt's): every completion's logits == transformers on prompt + that completion alone,
    also under a sliding window (measured on positions, not on the row's token order)."""
    from core.tiny import save_tiny_hf_model

    path = save_tiny_hf_model(tmp_path / family, family, sliding_window=window)
    rng = np.random.RandomState(6)
    prompt, completions = rng.randint(3, 512, 7), [rng.randint(3, 512, n) for n in (6, 3, 9)]
    row = np.concatenate([prompt, *completions])[None].astype(np.int32)
    branches = np.concatenate([[0] * 7] + [[k] * len(c) for k, c in enumerate(completions, start=1)])[None]
    positions = np.concatenate([np.arange(7)] + [7 + np.arange(len(c)) for c in completions])[None]
    model, _ = load_hf(path)
    out = np.asarray(
        model(
            row,
            positions=positions.astype(np.int32),
            segment_ids=np.ones_like(row),
            branch_ids=branches.astype(np.int32),
        )
    )
    start = 7
    for c in completions:
        ref = hf_logits(path, np.concatenate([prompt, c])[None])[0]
        assert np.abs(out[0, :7] - ref[:7]).max() <= TOL  # the shared prompt
        assert np.abs(out[0, start : start + len(c)] - ref[7:]).max() <= TOL
        start += len(c)


@pytest.mark.parametrize("layers", ["scan, unrolled", "scan, rolled", "loop"])
def test_layer_states_match_transformers_hidden_states(tmp_path, layers):
    """`Decoder.layer_states`: the residual stream after decoder layer l == transformers' hidden_states[l]
    (l < L; its entry L is after the final norm, as our final hidden states are), in the order asked, with the
    final hidden states unchanged by asking."""
    from core.tiny import save_tiny_hf_model

    path = save_tiny_hf_model(tmp_path / "qwen3_4", "qwen3", num_hidden_layers=4)
    tokens = np.random.RandomState(6).randint(0, 512, (2, 20))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = [h.numpy() for h in hf(torch.tensor(tokens), output_hidden_states=True).hidden_states]
    model, _ = load_hf(path, scan_layers=layers != "loop", scan_unroll=layers != "scan, rolled")
    final, states = model.layer_states(tokens.astype(np.int32), layers=(3, 1, 2))
    assert len(states) == 3
    for got, layer in zip(states, (3, 1, 2), strict=True):
        assert np.abs(np.asarray(got) - ref[layer]).max() <= TOL, layer
    assert np.abs(np.asarray(final) - ref[4]).max() <= TOL
    np.testing.assert_array_equal(np.asarray(final), np.asarray(model.hidden_states(tokens.astype(np.int32))))
    with pytest.raises(ValueError, match=r"layer 5 is not a decoder layer of this model \(1..4\)"):
        model.layer_states(tokens.astype(np.int32), layers=(5,))
