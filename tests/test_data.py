"""Grain pipelines: sources, tokenisation, packing/padding, shuffling, sharding, resumable state, bad rows."""

import json
from pathlib import Path

import datasets
import jax
import numpy as np
import pytest

from core.config import DataConfig
from core.data import MalformedRow, TextRows, load_tokenizer, tokenize_examples
from core.sources import load_records
from tests.helpers import pipeline

TEXTS = [f"Calculate {i} + {i + 1}.\nAnswer: {2 * i + 1}" for i in range(40)]


def cfg(**kw):
    base = dict(seq_len=32, seed=0)
    base.update(kw)
    return DataConfig(**base)


def make_pipeline(c, batch_size, *, records, tokenizer_dir, **kw):
    return pipeline(records, c, batch_size, tokenizer_dir, **kw)


def as_rows(data):
    """A DataBatch in the row layout: tokens, segment_ids, positions, example_ids `[B, L]`, and the target positions
    of each row (position k is a target when the hidden state at k - 1 predicts it)."""
    b = data.batch
    length = b.tokens.shape[1]
    targets = [
        sorted(int(i) % length + 1 for i, m in zip(b.target_index[r], b.target_mask[r]) if m)
        for r in range(b.tokens.shape[0])
    ]
    return {
        "tokens": b.tokens,
        "segment_ids": b.segment_ids,
        "positions": b.positions,
        "example_ids": data.example_ids,
        "targets": targets,
    }


def rows_of(batch):
    """Per row: list of (example_id, tokens) for each packed document."""
    out = []
    for r in range(batch["tokens"].shape[0]):
        docs = {}
        for t in range(batch["tokens"].shape[1]):
            seg = batch["segment_ids"][r, t]
            if seg:
                docs.setdefault(seg, []).append(
                    (batch["example_ids"][r, t], batch["tokens"][r, t], batch["positions"][r, t])
                )
        out.append(docs)
    return out


def test_packing_layout_matches_tokenizer(arithmetic_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    records = [{"text": t} for t in TEXTS]
    data = next(iter(make_pipeline(cfg(shuffle=False), 4, records=records, tokenizer_dir=arithmetic_tokenizer)))
    batch = as_rows(data)
    assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == np.int32
    assert data.batch.target_ids.shape == data.batch.target_index.shape == (4, 32)
    n_docs = 0
    for docs in rows_of(batch):
        for _seg, items in docs.items():
            ids = {int(i) for i, _, _ in items}
            assert len(ids) == 1  # one document per segment
            (eid,) = ids
            want = tok(TEXTS[eid], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert [int(t) for _, t, _ in items] == want[:32]
            assert [int(p) for _, _, p in items] == list(range(len(items)))  # positions restart per document
            n_docs += 1
    assert n_docs > 4  # several documents were packed per row
    assert ((batch["segment_ids"] == 0) == (batch["example_ids"] == -1)).all()
    # text: every token of a document but its first is a target, predicted from the token before it
    seg = batch["segment_ids"]
    for r in range(4):
        want = [k for k in range(1, 32) if seg[r, k] > 0 and seg[r, k] == seg[r, k - 1]]
        assert batch["targets"][r] == want
        n = len(want)
        np.testing.assert_array_equal(data.batch.target_ids[r, :n], batch["tokens"][r, want])


def test_padding_mode(arithmetic_tokenizer):
    records = [{"text": t} for t in TEXTS]
    batch = as_rows(
        next(
            iter(
                make_pipeline(cfg(packing=False, shuffle=False), 3, records=records, tokenizer_dir=arithmetic_tokenizer)
            )
        )
    )
    assert (batch["example_ids"][:, 0] == [0, 1, 2]).all()
    for r in range(3):
        n = int(batch["segment_ids"][r].sum())
        assert (batch["segment_ids"][r, :n] == 1).all() and (batch["segment_ids"][r, n:] == 0).all()
        assert (batch["positions"][r, :n] == np.arange(n)).all()


def test_shuffle_is_seeded_and_epochs_reshuffle(arithmetic_tokenizer):
    records = [{"text": t} for t in TEXTS]

    def first_ids(seed, n=30):
        it = iter(make_pipeline(cfg(packing=False, seed=seed), 2, records=records, tokenizer_dir=arithmetic_tokenizer))
        return [int(x) for _ in range(n) for x in next(it).example_ids[:, 0]]

    a, b, c = first_ids(0), first_ids(0), first_ids(1)
    assert a == b and a != c
    assert sorted(a[:40]) == list(range(40))  # first epoch: every example exactly once
    assert a[:20] != a[40:60]  # second epoch is a different permutation


def test_state_restores_exact_next_batch(arithmetic_tokenizer):
    records = [{"text": t} for t in TEXTS]
    pipe = make_pipeline(cfg(), 4, records=records, tokenizer_dir=arithmetic_tokenizer)
    it = iter(pipe)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    fresh = iter(make_pipeline(cfg(), 4, records=records, tokenizer_dir=arithmetic_tokenizer))
    fresh.set_state(state)
    for want in expected:
        got = next(fresh)
        np.testing.assert_array_equal(got.example_ids, want.example_ids)
        for a, b in zip(jax.tree.leaves(got.batch), jax.tree.leaves(want.batch)):
            np.testing.assert_array_equal(a, b)


def test_process_sharding_is_disjoint(arithmetic_tokenizer):
    records = [{"text": t} for t in TEXTS]
    from core.data import make_pipeline as core_pipeline

    c = cfg(packing=False, shuffle=False)
    examples = tokenize_examples(records, TextRows(), load_tokenizer(arithmetic_tokenizer), c)
    seen = []
    for p in range(2):
        pipe = core_pipeline(examples, c, 4, process_index=p, process_count=2)
        assert len(pipe.rows) == 20
        it = iter(pipe)
        seen.append({int(x) for _ in range(5) for x in next(it).example_ids[:, 0]})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 40


def test_eval_split_is_held_out_and_finite(arithmetic_tokenizer):
    records = [{"text": t} for t in TEXTS]
    c = cfg(eval_fraction=0.25, packing=False)
    ev = list(make_pipeline(c, 4, records=records, tokenizer_dir=arithmetic_tokenizer, split="eval"))
    eval_ids = {int(x) for b in ev for x in b.example_ids[:, 0]}
    assert eval_ids == set(range(30, 40))
    it = iter(make_pipeline(c, 5, records=records, tokenizer_dir=arithmetic_tokenizer))
    train_ids = {int(x) for _ in range(6) for x in next(it).example_ids[:, 0]}
    assert train_ids == set(range(30))


def test_chat_and_prompt_completion_targets(arithmetic_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    chat = [{"messages": [{"role": "user", "content": "Calculate 1 + 2."}, {"role": "assistant", "content": "3"}]}]
    data = next(
        iter(make_pipeline(cfg(format="chat", packing=False), 1, records=chat * 2, tokenizer_dir=arithmetic_tokenizer))
    )
    b = as_rows(data)
    # only the assistant answer and its end-of-turn token are targets
    assert tok.decode(b["tokens"][0, b["targets"][0]]) == "3<|im_end|>"
    pc = [{"prompt": "Calculate 1 + 2.", "completion": " 3"}]
    data = next(
        iter(
            make_pipeline(
                cfg(format="prompt_completion", packing=False), 1, records=pc * 2, tokenizer_dir=arithmetic_tokenizer
            )
        )
    )
    b = as_rows(data)
    assert tok.decode(b["tokens"][0, b["targets"][0]]) == " 3<|endoftext|>"  # the completion and EOS
    everything = as_rows(
        next(
            iter(
                make_pipeline(
                    cfg(format="prompt_completion", packing=False),
                    1,
                    records=pc * 2,
                    tokenizer_dir=arithmetic_tokenizer,
                    completion_only=False,
                )
            )
        )
    )
    n = int(everything["segment_ids"][0].sum())
    assert everything["targets"][0] == list(range(1, n))


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_side_and_rows_left_without_targets(arithmetic_tokenizer, side):
    """A long prompt cut to data.seq_len: on the right it loses its completion (no target left: an error naming the
    row, or skipped and counted), on the left it keeps the completion."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    rows = [
        {"prompt": "Calculate 1 + 2. " * 10, "completion": " 3"},
        {"prompt": "Calculate 2 + 2.", "completion": " 4"},
    ]
    c = cfg(format="prompt_completion", packing=False, shuffle=False, seq_len=16, truncation_side=side)
    if side == "right":
        with pytest.raises(
            MalformedRow,
            match=r"row 0: no target token left \(16 tokens after truncation to "
            r"data.seq_len=16 on the right",
        ):
            make_pipeline(c, 1, records=rows, tokenizer_dir=arithmetic_tokenizer)
        from posttrain.sft import PromptCompletionRows

        skipping = c.model_copy(update={"skip_malformed": True})
        examples = tokenize_examples(rows, PromptCompletionRows(), tok, skipping)
        assert examples.train == [1] and "row 0: no target token left" in examples.skipped[0]
        return
    b = as_rows(next(iter(make_pipeline(c, 1, records=rows, tokenizer_dir=arithmetic_tokenizer))))
    assert tok.decode(b["tokens"][0, b["targets"][0]]) == " 3<|endoftext|>"  # the end kept, the prompt's start cut
    assert int(b["segment_ids"][0].sum()) == 16


def test_local_files_and_save_to_disk(tmp_path, arithmetic_tokenizer):
    rows = [{"text": t} for t in TEXTS[:10]]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    for source in (jsonl, tmp_path / "d.parquet", tmp_path / "disk"):
        c = cfg(source=str(source), tokenizer_dir=arithmetic_tokenizer, packing=False, shuffle=False)
        records = load_records(c)
        assert [r["text"] for r in records] == TEXTS[:10]
        assert next(iter(make_pipeline(c, 2, records=records, tokenizer_dir=arithmetic_tokenizer))).batch.rows == 2


@pytest.mark.parametrize("packing", [False, True])
def test_rows_are_cut_to_the_longest_row_and_only_padding_is_dropped(packing, arithmetic_tokenizer):
    """Short rows are cut to the batch's longest real row rounded up to seq_len / 8, like a pad-to-longest collator;
    every real token, segment and target is still there (compared with the uncut layout)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    records = [{"text": t} for t in TEXTS[:8]]
    c = cfg(seq_len=128, packing=packing, shuffle=False)
    data = next(iter(make_pipeline(c, 4, records=records, tokenizer_dir=arithmetic_tokenizer)))
    b = as_rows(data)
    real = (b["segment_ids"] > 0).sum(axis=1)
    width = b["tokens"].shape[1]
    assert width % 16 == 0 and width - 16 < real.max() <= width  # cut to the next multiple of 16
    assert packing or width < 128  # unpacked, these ~16-token documents leave most of a row empty
    assert not (b["segment_ids"][:, real.min() :] > 0).all(axis=1).any()  # padding only after the real tokens
    expected_targets = 0
    for docs in rows_of(b):
        for items in docs.values():
            (eid,) = {int(i) for i, _, _ in items}
            want = tok(TEXTS[eid], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert [int(t) for _, t, _ in items] == want  # whole documents, nothing cut but padding
            expected_targets += len(want) - 1  # every token after a document's first
    assert sum(len(t) for t in b["targets"]) == expected_targets


def test_reasoning_gym_source():
    c = cfg(source="reasoning_gym:basic_arithmetic", num_examples=5, seed=3)
    recs = load_records(c)
    assert len(recs) == 5 and all(r["text"].endswith(r["answer"]) for r in recs)
    assert recs == load_records(c)


def test_missing_file_is_named():
    with pytest.raises(FileNotFoundError, match="no/such.jsonl"):
        load_records(cfg(source="no/such.jsonl"))


def test_columns_take_fields_from_other_columns(tmp_path):
    rows = [{"content": t, "other": i} for i, t in enumerate(TEXTS[:3])]
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_records(cfg(source=str(source), columns={"text": "content"}))
    assert [r["text"] for r in records] == TEXTS[:3] and records[0]["other"] == 0
    with pytest.raises(ValueError, match=r"data.columns names \['body'\], which the rows do not have"):
        load_records(cfg(source=str(source), columns={"text": "body"}))


@pytest.mark.parametrize(
    "row,field,what",
    [
        ({"txt": "hello"}, "text", "missing"),
        ({"text": 3}, "text", "expected a string, got int"),
        ({"text": "   "}, "text", "empty text"),
    ],
)
def test_malformed_row_named_or_skipped(arithmetic_tokenizer, row, field, what):
    records = [{"text": t} for t in TEXTS[:5]] + [row] + [{"text": t} for t in TEXTS[5:10]]
    with pytest.raises(MalformedRow, match=f"row 5: field '{field}': {what}"):
        make_pipeline(cfg(), 2, records=records, tokenizer_dir=arithmetic_tokenizer)
    c = cfg(skip_malformed=True, packing=False, shuffle=False)
    examples = tokenize_examples(records, TextRows(), load_tokenizer(arithmetic_tokenizer), c)
    assert len(examples.train) == 10 and len(examples.skipped) == 1 and "row 5" in examples.skipped[0]
    it = iter(make_pipeline(c, 2, records=records, tokenizer_dir=arithmetic_tokenizer))
    ids = [int(x) for _ in range(5) for x in next(it).example_ids[:, 0]]
    assert sorted(ids) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]  # one epoch, row 5 skipped


def test_malformed_chat_row(arithmetic_tokenizer):
    with pytest.raises(MalformedRow, match=r"row 0: field 'messages\[1\]'"):
        make_pipeline(
            cfg(format="chat"),
            1,
            records=[{"messages": [{"role": "user", "content": "x"}, {"role": 1}]}],
            tokenizer_dir=arithmetic_tokenizer,
        )


def test_a_chat_row_a_template_cannot_render_is_named_or_skipped(tmp_path):
    """A conversation opening with an assistant turn, under Gemma's template (roles must alternate): an error
    naming the row and the template's reason, or with data.skip_malformed skipped and counted."""
    from posttrain.sft import ChatRows
    from tests.chat_families import chat_tokenizer

    tok = chat_tokenizer(tmp_path / "gemma", "gemma")
    good = {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]}
    opening = {"messages": [{"role": "assistant", "content": "Hi."}, *good["messages"]]}
    rows = [good, opening, good]
    with pytest.raises(MalformedRow, match="row 1: .*roles must alternate"):
        tokenize_examples(rows, ChatRows(), tok, cfg(format="chat"))
    examples = tokenize_examples(rows, ChatRows(), tok, cfg(format="chat", skip_malformed=True))
    assert examples.train == [0, 2] and len(examples.skipped) == 1 and "row 1" in examples.skipped[0]


def test_held_out_rows_are_the_last_usable_ones(arithmetic_tokenizer):
    """The one split every method uses: the last data.eval_fraction of the usable rows (a skipped row is not
    counted), never a training row."""
    from core.data import held_out

    assert held_out(list(range(10)), 0.2) == (list(range(8)), [8, 9])
    records = [{"text": t} for t in TEXTS[:9]] + [{"text": ""}]
    c = cfg(eval_fraction=0.2, skip_malformed=True)
    examples = tokenize_examples(records, TextRows(), load_tokenizer(arithmetic_tokenizer), c)
    assert examples.eval == [7, 8] and examples.train == list(range(7))


def test_open_tokenizer_builds_what_autotokenizer_builds(arithmetic_tokenizer, tmp_path):
    """A tokenizer directory (Temper's, no model beside it) is built directly, as the class AutoTokenizer would
    build, with the same ids; beside a qwen2 model's config.json, where transformers 5 builds the family's own
    class instead of the one named, it goes through AutoTokenizer (the tokenizer vLLM builds from that directory)."""
    import shutil

    from transformers import AutoTokenizer

    from core.tiny import save_tiny_hf_model
    from core.tokenizer import open_tokenizer

    text = "Calculate 4821 + 3907.\nAnswer: 8728"
    ours, auto = open_tokenizer(arithmetic_tokenizer), AutoTokenizer.from_pretrained(arithmetic_tokenizer)
    assert type(ours) is type(auto) and ours(text)["input_ids"] == auto(text)["input_ids"]
    model = save_tiny_hf_model(tmp_path / "model", "qwen2", vocab_size=512)
    for f in Path(arithmetic_tokenizer).iterdir():
        shutil.copy(f, model / f.name)
    ours, auto = open_tokenizer(model), AutoTokenizer.from_pretrained(model)
    assert type(ours) is type(auto) and ours(text)["input_ids"] == auto(text)["input_ids"]
