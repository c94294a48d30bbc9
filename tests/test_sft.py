"""SFT on the shared skeleton: packed conversations vs transformers, gradients unchanged by packing and
micro-batching, and the recipe end to end from a chat dataset to an HF export transformers loads."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from core.config import DataConfig
from tests.chat_families import chat_tokenizer
from tests.helpers import assert_same_gradients, pipeline, recording_sgd


def make_pipeline(c, batch_size, *, records, tokenizer_dir, **kw):
    return pipeline(records, c, batch_size, tokenizer_dir, **kw)


def chats(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn conversations of unequal lengths: a system turn, then one to three user / assistant turns."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You add numbers."}]
        for _ in range(int(rng.integers(1, 4))):
            a, b = (int(x) for x in rng.integers(0, 100, 2))
            messages += [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
            ]
        rows.append({"messages": messages})
    return rows


def tool_chats(n: int, seed: int = 0, offer: bool = True) -> list[dict]:
    """Conversations in which the assistant calls the calculator (a structured `tool_calls` turn), reads its result
    (a `tool` message) and answers; with `offer`, the row offers the tool's schema (`tools`, rendered into the
    system turn: a few hundred tokens)."""
    from rollout.calculator import calculator
    from rollout.tools import tool_schema

    rng, schema = np.random.default_rng(seed), tool_schema(calculator)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(100, 1000, 2))
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
        messages = [
            {"role": "system", "content": "You multiply numbers."},
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": f"{a} * {b} = {a * b}."},
        ]
        rows.append({"messages": messages, "tools": [schema]} if offer else {"messages": messages})
    return rows


def test_sft_rows_train_on_tool_calls_and_name_a_malformed_one(qwen_chat):
    """A chat row with a structured tool call: the call's turn and the answer are targets, the tool's result is
    context (the template's rendering with the row's `tools`); a malformed call is named where it is."""
    from core.data import load_tokenizer
    from posttrain.sft import row_format

    tok = load_tokenizer(qwen_chat[0])
    rows = row_format("chat", completion_only=True)
    row = tool_chats(1, seed=3)[0]
    assert rows.problem(row) is None
    ids, targets = rows.tokenize(row, tok)
    assert ids == list(tok.apply_chat_template(row["messages"], tools=row["tools"], return_dict=True)["input_ids"])
    trained = tok.decode([ids[k] for k in targets], skip_special_tokens=False)
    product = row["messages"][3]["content"]
    assert trained.startswith('<tool_call>\n{"name": "calculator"') and trained.count(product) == 1, trained
    assert trained.endswith(f"= {product}.<|im_end|>") and "calculator" in tok.decode(ids)  # the schema, rendered
    as_string = json.loads(json.dumps(row))  # OpenAI's form of the arguments: a JSON string, read as the object
    call = as_string["messages"][2]["tool_calls"][0]["function"]
    call["arguments"] = json.dumps(call["arguments"])
    assert rows.problem(as_string) is None and rows.tokenize(as_string, tok) == (ids, targets)
    call["arguments"] = "expression: 12 * 7"
    assert rows.problem(as_string)[0] == "messages[2].tool_calls[0].function.arguments"
    bad = json.loads(json.dumps(row))
    bad["messages"][2]["tool_calls"][0]["function"].pop("name")
    assert rows.problem(bad) == ("messages[2].tool_calls[0]", "expected {function: {name: str, arguments: ...}}")
    bad["messages"][2]["tool_calls"] = [{"function": {"name": "calculator", "arguments": 7}}]
    assert rows.problem(bad)[0] == "messages[2].tool_calls[0].function.arguments"
    bad["messages"][3]["tool_calls"] = row["messages"][2]["tool_calls"]
    bad["messages"][2] = row["messages"][2]
    assert rows.problem(bad) == ("messages[3].tool_calls", "only an assistant message calls tools, not a 'tool' one")
    assert rows.problem({**row, "tools": "calculator"}) == ("tools", "expected a list of JSON schemas (objects)")


@pytest.fixture(scope="module")
def qwen_chat(tmp_path_factory):
    """A Qwen2.5-style tokenizer directory (ChatML, no generation markers) and a tiny random Qwen2 HF model."""
    from core.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("sft")
    corpus = [m["content"] for row in chats(50) + tool_chats(20) for m in row["messages"]]
    corpus += ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'] * 20
    chat_tokenizer(root / "qwen2.5", "qwen2_5", corpus=corpus)
    return str(root / "qwen2.5"), str(save_tiny_hf_model(root / "model", "qwen2", max_position_embeddings=512))


def data_cfg(**kw) -> DataConfig:
    return DataConfig(**{"format": "chat", "seq_len": 256, "shuffle": False, **kw})


def test_packed_conversations_give_each_conversations_own_logits(qwen_chat):
    """Several conversations in one row (segment ids, positions restarting per conversation): the logits at
    every position equal transformers' on that conversation alone."""
    import torch
    import transformers

    from core.hf.directory import load_hf

    tokenizer_dir, hf_dir = qwen_chat
    batch = next(iter(make_pipeline(data_cfg(packing=True), 2, records=chats(12), tokenizer_dir=tokenizer_dir)))
    packed = batch.batch
    assert int(packed.segment_ids[0].max()) >= 3  # the row really holds several conversations
    model, _ = load_hf(hf_dir)
    ours = np.asarray(model(packed.tokens, packed.positions, packed.segment_ids))  # [R, L, V]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    checked = 0
    for r in range(packed.rows):
        for seg in range(1, int(packed.segment_ids[r].max()) + 1):
            where = np.flatnonzero(packed.segment_ids[r] == seg)
            np.testing.assert_array_equal(packed.positions[r, where], np.arange(len(where)))
            with torch.no_grad():
                ref = hf(torch.tensor(packed.tokens[r, where][None], dtype=torch.long)).logits[0].numpy()
            # float32 on both sides: within 64 float32 steps of the largest logit
            tol = 64 * float(np.spacing(np.float32(np.abs(ref).max())))
            np.testing.assert_allclose(ours[r, where], ref, rtol=0, atol=tol)
            checked += 1
    assert checked >= 5


def _gradient(tokenizer_dir: str, hf_dir: str, batch, micro_batches: int):
    """The gradient of the SFT loss (mean over the batch's targets) at the HF model's weights."""
    from core.config import OptimConfig
    from core.hf.directory import load_hf
    from core.learner import Learner
    from core.losses import nll_loss
    from core.mesh import single_device_mesh

    mesh = single_device_mesh()
    with jax.set_mesh(mesh):
        model, _ = load_hf(hf_dir, mesh=mesh)
    learner = Learner(model, mesh, nll_loss, OptimConfig(), total_updates=1, tx=recording_sgd(1.0))
    metrics = learner.update(batch, micro_batches)
    return metrics, jax.device_get(learner.state.opt_state)


def test_packing_and_micro_batches_leave_the_gradient_unchanged(qwen_chat):
    """The same conversations one per row, packed into rows, and packed in 4 micro-batches: the same loss and
    gradient (the loss is normalised over the targets of the whole global batch, whatever the target width)."""
    tokenizer_dir, hf_dir = qwen_chat
    rows = chats(40, seed=1)
    packed = {
        k: next(
            iter(make_pipeline(data_cfg(packing=True), 4, records=rows, tokenizer_dir=tokenizer_dir, micro_batches=k))
        )
        for k in (1, 4)
    }
    np.testing.assert_array_equal(packed[1].example_ids, packed[4].example_ids)
    seen = sorted({int(i) for i in packed[1].example_ids.ravel() if i >= 0})
    assert len(seen) > 4  # more conversations than rows
    one_per_row = next(
        iter(
            make_pipeline(
                data_cfg(packing=False), len(seen), records=[rows[i] for i in seen], tokenizer_dir=tokenizer_dir
            )
        )
    )
    # completion-only targets are compacted: the target axis is narrower than the rows, and differs by layout
    widths = {one_per_row.batch.target_mask.shape[1], packed[1].batch.target_mask.shape[1]}
    assert max(widths) < data_cfg().seq_len and len(widths) == 2, widths
    base_metrics, base = _gradient(tokenizer_dir, hf_dir, one_per_row.batch, 1)
    assert base_metrics.denominator == float(np.asarray(packed[1].batch.target_mask).sum()) > 0
    for k in (1, 4):
        metrics, grads = _gradient(tokenizer_dir, hf_dir, packed[k].batch, k)
        assert metrics.loss == pytest.approx(base_metrics.loss, rel=1e-6)
        assert_same_gradients(base, grads)


def test_padding_free_trains_the_same_conversations_in_fewer_rows(qwen_chat):
    """`data.padding_free`: a step's 8 conversations (the padded pipeline's 8, in the same steps) first-fit into
    fewer rows, each whole in its own segment with positions from 0, micro-batches keeping their own
    conversations in their own rows (a multiple of `row_multiple` each); the loss and gradient equal the padded
    batch's, in 1 micro-batch and in 2."""
    tokenizer_dir, hf_dir = qwen_chat
    rows = chats(40, seed=3)

    def first(k: int = 1, **kw):
        pipe = make_pipeline(
            data_cfg(packing=False, **kw), 8, records=rows, tokenizer_dir=tokenizer_dir, micro_batches=k, row_multiple=k
        )
        return next(iter(pipe))

    padded, free, free2 = first(), first(padding_free=True), first(2, padding_free=True)
    ids = np.asarray(free.example_ids)
    assert free.batch.rows < padded.batch.rows == 8 and free2.batch.rows % 4 == 0
    for r in range(padded.batch.rows):  # every padded row's conversation, whole, in one segment of a free row
        example = int(padded.example_ids[r, 0])
        n = int((np.asarray(padded.batch.segment_ids[r]) > 0).sum())
        row, where = np.nonzero(ids == example)
        assert len(set(row)) == 1 and len(where) == n and np.array_equal(where, where[0] + np.arange(n))
        np.testing.assert_array_equal(free.batch.tokens[row[0], where], padded.batch.tokens[r, :n])
        np.testing.assert_array_equal(free.batch.positions[row[0], where], np.arange(n))
        assert len(set(np.asarray(free.batch.segment_ids)[row[0], where])) == 1
    assert int(np.asarray(free.batch.segment_ids).max()) >= 2  # rows really hold several conversations
    ids2 = np.asarray(free2.example_ids)
    half = free2.batch.rows // 2
    first_four = {int(i) for i in padded.example_ids[:4, 0]}
    assert {int(i) for i in ids2[:half].ravel() if i >= 0} == first_four  # micro-batch 1's rows
    base_metrics, base = _gradient(tokenizer_dir, hf_dir, padded.batch, 1)
    for batch, k in ((free.batch, 1), (free2.batch, 2)):
        metrics, grads = _gradient(tokenizer_dir, hf_dir, batch, k)
        assert metrics.denominator == base_metrics.denominator > 0
        assert metrics.loss == pytest.approx(base_metrics.loss, rel=1e-6)
        assert_same_gradients(base, grads)


@pytest.mark.parametrize(
    "lengths, width",
    [
        ([34] * 4, 80),  # pairs just over half of 64 share rows of 80: 2 rows cut to 70, not 4 rows cut to 40
        ([32] * 8, 64),  # pairs fill rows of 64 exactly: 4 x 64, where rows of 80 hold no more
    ],
)
def test_padding_free_rows_widen_only_when_that_takes_fewer_positions(lengths, width):
    from core.data import _padding_free

    elements = [
        {"tokens": np.full(n, i + 1), "loss_mask": np.ones(n, np.int32), "example_ids": np.full(n, i)}
        for i, n in enumerate(lengths)
    ]
    out = _padding_free(elements, 64, 1, 1)
    assert out["tokens"].shape[1] == width
    per_row = (out["segment_ids"] > 0).sum(axis=1)
    assert per_row.sum() == sum(lengths) and out["tokens"].shape[0] == -(-sum(lengths) // (2 * lengths[0]))
    assert sorted(set(out["example_ids"].ravel()) - {-1}) == list(range(len(lengths)))  # every example, once


def test_held_out_generations_come_from_the_eval_split(qwen_chat):
    """The prompts SFT generates from at each evaluation are held-out rows: never a training row, never a row
    skipped as malformed (here the raw tail of the rows holds one of each kind)."""
    from transformers import AutoTokenizer

    from core.data import tokenize_examples
    from posttrain.sft import ChatRows, held_out_prompts

    tokenizer_dir, _ = qwen_chat
    rows = chats(20, seed=4)
    rows[-1] = {"messages": [{"role": "user", "content": 3}]}  # malformed, last of all
    c = data_cfg(eval_fraction=0.2, skip_malformed=True)
    examples = tokenize_examples(rows, ChatRows(), AutoTokenizer.from_pretrained(tokenizer_dir), c)
    assert examples.eval == [15, 16, 17, 18] and len(examples.skipped) == 1
    prompts = held_out_prompts(rows, examples, "chat", 10)
    want = [(rows[i]["messages"][:-1], rows[i]["messages"][-1]["content"]) for i in examples.eval]
    assert prompts == want


def test_padding_free_needs_packing_off():
    with pytest.raises(ValueError, match="data.padding_free"):
        DataConfig(packing=True, padding_free=True)


@pytest.mark.integration
def test_sft_recipe_from_chats_to_an_hf_export(tmp_path, qwen_chat):
    """`python -m recipes.sft` on multi-turn chats from a local jsonl, a third of them calling a tool (structured
    `tool_calls`, `tool` results, the rows' `tools`): the held-out loss goes down, greedy generations are logged,
    and the HF export loads in transformers with the checkpoint's logits."""
    import torch
    import transformers

    from core.checkpoint_models import load_checkpoint_model
    from core.metrics import read_metrics
    from recipes.sft import main

    tokenizer_dir, _ = qwen_chat
    source = tmp_path / "chats.jsonl"
    plain, calling = iter(chats(267, seed=2)), iter(tool_chats(133, seed=2, offer=False))
    mixed = [next(calling) if i % 3 == 2 else next(plain) for i in range(400)]
    source.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "recipes/configs/sft_tiny.yml",
                f"run.run_dir={run_dir}",
                f"data.source={source}",
                f"data.tokenizer_dir={tokenizer_dir}",
                "data.eval_fraction=0.05",
                "data.seq_len=96",
                "train.steps=30",
                "train.eval_every=15",
                "train.log_every=5",
                "checkpoint.every_steps=15",
                "logging.tensorboard=false",
            ]
        )
        == 0
    )
    rows = read_metrics(run_dir)
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.2, evals  # measured: 2.36 -> 1.95
    generations = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [15] * 4 + [30] * 4
    assert generations[0]["prompt"][-1]["role"] in ("user", "tool") and isinstance(generations[0]["output"], str)

    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32).eval()
    model, _, _ = load_checkpoint_model(run_dir / "checkpoints")
    ids = np.asarray([[5, 17, 42, 99, 3, 250, 7, 11]], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = np.asarray(model(ids, np.arange(8, dtype=np.int32)[None], np.ones_like(ids)))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=64 * float(np.spacing(np.float32(np.abs(ref).max()))))
