"""DPO on the shared skeleton: pair rows -> tokens (text and chat, malformed rows named), the shared-prompt layout
vs transformers on each sequence alone, the objective vs a NumPy DPO of transformers' log-probs, a live
reference, and micro-batching on gradients."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from core.data import MalformedRow
from posttrain.config import DPOConfig
from posttrain.dpo.pairs import Pair, build_pair_batch, tokenize_pairs
from tests.chat_families import chat_tokenizer
from tests.helpers import assert_same_gradients, recording_sgd


def random_pairs(n: int, vocab: int, seed: int = 0) -> list[Pair]:
    rng = np.random.default_rng(seed)
    ids = lambda k: tuple(int(x) for x in rng.integers(1, vocab, k))
    return [Pair(i, ids(rng.integers(3, 20)), ids(rng.integers(2, 16)), ids(rng.integers(2, 16))) for i in range(n)]


def hf_completion_logps(hf, prompt, completion) -> np.ndarray:
    """transformers' per-token log-probs of `completion` after `prompt`, the sequence alone."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long)
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].double(), -1).numpy()
    p = len(prompt)
    return np.array([logp[p - 1 + j, t] for j, t in enumerate(completion)])


@pytest.fixture(scope="module")
def llama(tiny_hf_dir):
    import torch
    import transformers

    from core.hf.directory import load_hf

    path = tiny_hf_dir("llama")
    model, cfg = load_hf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, cfg, hf


def test_shared_prompt_layout_gives_each_sequences_own_log_probs(llama):
    """Chosen and rejected after one copy of their prompt, several pairs per row: every completion token's
    log-prob equals transformers' on prompt + that completion alone."""
    from core.targets import target_logprobs

    _, model, cfg, hf = llama
    pairs = random_pairs(6, cfg.vocab_size)
    batch = build_pair_batch(pairs, slots=8, row_len=96)
    assert batch.packed.rows < 6 and int(np.asarray(batch.packed.branch_ids).max()) == 2  # packed, branched
    np.testing.assert_array_equal(batch.pair_mask, [1] * 6 + [0] * 2)
    logp, _ = target_logprobs(model, batch.packed)
    logp, mask = np.asarray(logp), np.asarray(batch.packed.target_mask)
    for i, pair in enumerate(pairs):
        for side, completion in ((0, pair.chosen), (1, pair.rejected)):
            row = 2 * i + side
            n = len(completion)
            assert mask[row].sum() == n
            ref = hf_completion_logps(hf, pair.prompt, completion)
            tol = 64 * np.spacing(np.abs(ref).astype(np.float32))  # float32 steps at each value
            np.testing.assert_array_less(np.abs(logp[row, :n] - ref), tol)
    assert not mask[12:].any()  # empty slots score nothing


@pytest.mark.parametrize("groups", [1, 2])
def test_the_head_scores_real_targets_only_with_the_same_values_and_gradients(llama, groups):
    """`scored` real targets per micro-batch as a flat list (what `split_micro_batches` sets) == every [B, C]
    slot scored: log-probs and entropies on real targets, zeros on empty slots, gradients of a loss that reads
    both."""
    from flax import nnx

    from core.batch import with_scored
    from core.targets import target_logprobs
    from core.train import split_micro_batches

    _, model, cfg, _ = llama
    pairs = random_pairs(8, cfg.vocab_size, seed=3)
    whole = build_pair_batch(pairs, slots=8, row_len=64, groups=groups).packed
    mask = np.asarray(whole.target_mask)
    b, c = mask.shape
    assert whole.groups == groups
    flat = with_scored(whole)
    per_group = mask.reshape(groups, -1).sum(axis=1)
    assert per_group.max() <= flat.scored < b * c // groups  # the flat path, and no real target left out
    weights = np.random.default_rng(4).normal(size=mask.shape).astype(np.float32) * mask
    graphdef, params = nnx.split(model)

    def scored(batch):  # grads and [B, C] outputs over the micro-batches, as the train step walks them
        def loss(p, micro, w):
            logp, ent = target_logprobs(nnx.merge(graphdef, p), micro)
            return (w * (logp + 0.1 * ent)).sum(), (logp, ent)

        split = jax.tree.map(lambda x: x.reshape(groups, -1, *x.shape[1:]), batch)  # keeps `scored` as it is
        grads, outs = None, []
        for g in range(groups):
            micro = jax.tree.map(lambda x, g=g: x[g], split)
            w = weights.reshape(groups, -1, c)[g]
            gr, out = jax.jit(jax.grad(loss, has_aux=True))(params, micro, w)
            grads = gr if grads is None else jax.tree.map(np.add, grads, gr)
            outs.append(out)
        return grads, [np.concatenate([np.asarray(o[k]) for o in outs]) for k in (0, 1)]

    assert split_micro_batches(whole, groups).scored == flat.scored  # what a train step gets
    assert whole.scored == 0  # the reference: every slot through the head
    g_flat, (logp, ent) = scored(flat)
    g_all, (logp_all, ent_all) = scored(whole)
    real = mask > 0
    tol = 64 * np.spacing(np.abs(logp_all[real]).astype(np.float32))
    np.testing.assert_array_less(np.abs(logp[real] - logp_all[real]), tol)
    np.testing.assert_array_less(np.abs(ent[real] - ent_all[real]), 64 * np.spacing(ent_all[real]))
    assert not logp[~real].any() and not ent[~real].any()
    assert_same_gradients(g_flat, g_all)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "orpo"])
def test_objective_is_dpo_of_transformers_log_probs(llama, loss_type):
    """The objective's loss and metrics on a packed batch == NumPy DPO on transformers' sequence log-probs."""
    from posttrain.dpo.objective import preference_objective

    _, model, cfg, hf = llama
    pairs = random_pairs(5, cfg.vocab_size, seed=1)
    rng = np.random.default_rng(2)
    ref_c, ref_r = rng.normal(-60, 5, 8).astype(np.float32), rng.normal(-60, 5, 8).astype(np.float32)
    batch = build_pair_batch(pairs, slots=8, row_len=128).replace(ref_chosen=ref_c, ref_rejected=ref_r)
    dpo = DPOConfig(loss_type=loss_type, beta=0.2)
    out = jax.jit(lambda m, b: preference_objective(dpo)(m, b, jax.random.key(0)))(model, batch)
    pc = np.array([hf_completion_logps(hf, p.prompt, p.chosen).sum() for p in pairs])
    pr = np.array([hf_completion_logps(hf, p.prompt, p.rejected).sum() for p in pairs])
    nc, nr = np.array([len(p.chosen) for p in pairs]), np.array([len(p.rejected) for p in pairs])
    b = 0.2
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
    if loss_type == "sigmoid":
        h = (pc - ref_c[:5]) - (pr - ref_r[:5])
        want, chosen = -log_sigmoid(b * h), b * (pc - ref_c[:5])
    elif loss_type == "ipo":
        h = (pc - ref_c[:5]) / nc - (pr - ref_r[:5]) / nr
        want, chosen = (h - 1 / (2 * b)) ** 2, b * (pc - ref_c[:5]) / nc
    else:
        ac, ar = pc / nc, pr / nr
        log_odds = (ac - np.log(-np.expm1(ac))) - (ar - np.log(-np.expm1(ar)))
        want, chosen = -ac - b * log_sigmoid(log_odds), b * ac
    assert float(out.denominator) == 5.0  # the empty slots do not count
    assert float(out.total) == pytest.approx(want.sum(), rel=1e-5)
    assert float(out.sums.chosen) == pytest.approx(chosen.sum(), rel=1e-5, abs=1e-5)
    assert float(out.sums.logps_chosen) == pytest.approx(pc.sum(), rel=1e-5)


def test_a_live_reference_equal_to_the_policy_gives_zero_margins(llama):
    """With the reference a frozen copy of the policy (and another layout: one pair per row), every implicit
    reward is ~0 and the sigmoid loss is log 2."""
    from core.mesh import single_device_mesh
    from posttrain.dpo.objective import preference_objective, with_reference
    from posttrain.frozen import FrozenModel

    _, model, cfg, _ = llama
    pairs = random_pairs(4, cfg.vocab_size, seed=3)
    reference = FrozenModel.copy_of(model, single_device_mesh(), "reference")
    unpacked = with_reference(build_pair_batch(pairs, slots=4, row_len=64, pack=False), reference)
    packed = build_pair_batch(pairs, slots=4, row_len=128).replace(
        ref_chosen=unpacked.ref_chosen, ref_rejected=unpacked.ref_rejected
    )
    assert packed.packed.rows < unpacked.packed.rows
    assert (np.asarray(unpacked.ref_chosen) < -1).all()  # real log-probs, not zeros
    out = preference_objective(DPOConfig())(model, packed, jax.random.key(0))
    assert float(out.total) / 4 == pytest.approx(math.log(2), abs=1e-5)
    assert abs(float(out.sums.margins)) < 1e-4


def test_micro_batches_leave_the_gradient_unchanged(llama):
    """8 pairs in one micro-batch and in 4: the same loss and gradient (mean over the global batch's pairs)."""
    from core.config import OptimConfig
    from core.hf.directory import load_hf
    from core.learner import Learner
    from core.mesh import single_device_mesh
    from posttrain.dpo.objective import preference_objective

    path, _, cfg, _ = llama
    pairs = random_pairs(8, cfg.vocab_size, seed=4)
    rng = np.random.default_rng(5)
    refs = {k: rng.normal(-60, 5, 8).astype(np.float32) for k in ("ref_chosen", "ref_rejected")}
    mesh = single_device_mesh()
    results = []
    for k in (1, 4):
        batch = build_pair_batch(pairs, slots=8, row_len=96, groups=k).replace(**refs)
        with jax.set_mesh(mesh):
            model, _ = load_hf(path, mesh=mesh)
        loss = preference_objective(DPOConfig(loss_type="sigmoid", rpo_alpha=0.5))
        learner = Learner(model, mesh, loss, OptimConfig(), total_updates=1, tx=recording_sgd(1.0))
        update = learner.update(batch, k)
        results.append((update, jax.device_get(learner.state.opt_state)))
    (m1, g1), (m4, g4) = results
    for m in (m1, m4):  # both steps ran, on real pairs: a skipped or empty step would compare zeros with zeros
        assert m.finite == 1.0 and m.empty == 0.0 and m.denominator == 8.0 and np.isfinite(m.loss)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(g1)) > 1e-3
    assert m1.loss == pytest.approx(m4.loss, rel=1e-6)
    assert m1.metrics()["rewards/accuracies"] == pytest.approx(m4.metrics()["rewards/accuracies"])
    assert_same_gradients(g1, g4)


# ------------------------------------------------------------------ rows


def test_text_pairs_tokenize_with_eos_and_malformed_rows_are_named(arithmetic_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    good = {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6"}
    (pair,), _, _ = tokenize_pairs([good], tok, data_format="prompt_completion", seq_len=64)
    assert list(pair.prompt) == tok(good["prompt"], add_special_tokens=False)["input_ids"]
    assert list(pair.chosen) == tok(" 5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    bad = [
        ({"prompt": "x", "chosen": "a"}, "row 0: field 'rejected': missing"),
        ({"prompt": "x", "chosen": " 5", "rejected": " 5"}, "row 0: chosen and rejected are identical"),
        ({"prompt": "x", "chosen": 5, "rejected": " 6"}, "row 0: field 'chosen': expected a string"),
        ({"prompt": "x " * 40, "chosen": " 5", "rejected": " 6"}, r"row 0: prompt \d+ \+ chosen \d+ \+ rejected"),
    ]
    for row, message in bad:
        with pytest.raises(MalformedRow, match=message):
            tokenize_pairs([row], tok, data_format="prompt_completion", seq_len=32)
    rows = [good] + [row for row, _ in bad]
    pairs, skipped, _ = tokenize_pairs(rows, tok, data_format="prompt_completion", seq_len=32, skip_malformed=True)
    assert [p.row for p in pairs] == [0] and len(skipped) == 4 and "row 4:" in skipped[-1]
    # truncation: the prompt keeps its end, completions their start
    (cut,), _, _ = tokenize_pairs(
        [good], tok, data_format="prompt_completion", seq_len=64, max_prompt_tokens=2, max_completion_tokens=2
    )
    assert cut.prompt == pair.prompt[-2:] and cut.chosen == pair.chosen[:2] and cut.rejected == pair.rejected[:2]
    assert len(pair.chosen) > 2  # the cut really cut
    # completions identical once truncated carry no preference: dropped (and said), never an error
    same_start = {"prompt": "What is 2 + 3?", "chosen": " 5 and done", "rejected": " 5 or not"}
    kept, skipped, dropped = tokenize_pairs(
        [good, same_start], tok, data_format="prompt_completion", seq_len=64, max_completion_tokens=2
    )
    assert [p.row for p in kept] == [0] and not skipped and "row 1: chosen and rejected are identical" in dropped[0]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3", "qwen3", "deepseek_r1_distill"])
def test_chat_pairs_share_the_rendered_prompt_and_end_with_the_turns_end(tmp_path, family):
    """Chat pairs on the families' shipped templates: the prompt is the conversation through the generation
    prompt, each completion the assistant's answer and its end-of-turn token; a multi-turn (hh-rlhf style)
    prompt holding earlier assistant turns splits the same way; so do whole conversations with an implicit
    prompt."""
    from tests.chat_families import FAMILIES

    tok = chat_tokenizer(tmp_path / family, family)
    closers = FAMILIES[family]["closers"]
    history = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 10 + 7?"},
    ]
    row = {
        "prompt": history,
        "chosen": [{"role": "assistant", "content": "17"}],
        "rejected": [{"role": "assistant", "content": "18"}],
    }
    implicit = {"chosen": history + row["chosen"], "rejected": history + row["rejected"]}
    (pair, same), skipped, _ = tokenize_pairs([row, implicit], tok, data_format="chat", seq_len=256)
    assert not skipped and (pair.prompt, pair.chosen, pair.rejected) == (same.prompt, same.chosen, same.rejected)
    rendered = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert tok.decode(pair.prompt) == rendered
    chosen, rejected = tok.decode(pair.chosen), tok.decode(pair.rejected)
    assert chosen.endswith(closers) and rejected.endswith(closers), (chosen, rejected)
    assert "17" in chosen and "18" in rejected and "10 + 7" not in chosen + rejected
    two_turns = dict(row, chosen=[{"role": "assistant", "content": "5"}, {"role": "user", "content": "ok"}])
    with pytest.raises(MalformedRow, match="row 0: field 'chosen': expected a list of one assistant message"):
        tokenize_pairs([two_turns], tok, data_format="chat", seq_len=256)
    apart = {"chosen": history + row["chosen"], "rejected": history[:2] + row["rejected"]}
    with pytest.raises(MalformedRow, match="share every message but their last"):
        tokenize_pairs([apart], tok, data_format="chat", seq_len=256)
    # A row that offers tools: the prompt renders their schemas as the template does, and a chosen tool call is the
    # completion as the template writes it.
    from rollout.calculator import calculator
    from rollout.tools import tool_schema

    tools = [tool_schema(calculator)]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "10 + 7"}}}
    tooled = dict(row, chosen=[{"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools)
    if family not in ("qwen2_5", "qwen3"):  # templates that drop a call's name: refused, the turn named
        with pytest.raises(MalformedRow, match="message 4: the chat template does not write this assistant turn's"):
            tokenize_pairs([tooled], tok, data_format="chat", seq_len=4096)
        return
    (pair,), skipped, _ = tokenize_pairs([tooled], tok, data_format="chat", seq_len=4096)
    assert not skipped
    assert tok.decode(pair.prompt) == tok.apply_chat_template(
        history, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "calculator" in tok.decode(pair.prompt) and "10 + 7" in tok.decode(pair.chosen)
    whole = tok.apply_chat_template([*history, *tooled["chosen"]], tools=tools, tokenize=False)
    assert whole.startswith(tok.decode(pair.prompt)) and whole.rstrip().endswith(tok.decode(pair.chosen).rstrip())
