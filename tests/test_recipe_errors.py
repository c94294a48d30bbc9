"""A user's mistake is one clear message on stderr, exit code 2, no traceback (`--debug` shows it), and every
recipe answers `--help`. Malformed configs, YAML files, overrides, paths and data, tried as a new user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.cli import run_recipe

ROOT = Path(__file__).resolve().parents[1]
GRPO_TINY = ROOT / "recipes" / "configs" / "grpo_tiny.yml"


@pytest.fixture()
def files(tmp_path, arithmetic_tokenizer):
    """Malformed config files and data, by name."""

    def write(name, text):
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    bad_row = [*rows[:1], {"answer": "2"}, *rows[2:]]
    return {
        "tok": arithmetic_tokenizer,
        "unknown_key": write("unknown.yml", f"base_config: {GRPO_TINY}\nrl:\n  num_generation: 4\n"),
        "syntax": write("syntax.yml", "train:\n  steps: 3\n  eval_every: [1, 2\nrl: {}\n"),
        "empty": write("empty.yml", "# nothing here\n"),
        "duplicate": write("duplicate.yml", "train:\n  steps: 3\n  steps: 4\n"),
        "list": write("list.yml", "- train\n- rl\n"),
        "missing_base": write("missing_base.yml", "base_config: no_such_base.yml\n"),
        "cycle_a": write("cycle_a.yml", "base_config: cycle_b.yml\n"),
        "cycle_b": write("cycle_b.yml", "base_config: cycle_a.yml\n"),
        "bad_base": write("child_of_bad.yml", "base_config: syntax.yml\ntrain: {steps: 2}\n"),
        "dup_base": write("child_of_dup.yml", "base_config: duplicate.yml\n"),
        "scalar_section": write("scalar.yml", "train: 3\n"),
        "bad_row": write("bad_row.jsonl", "".join(json.dumps(r) + "\n" for r in bad_row)),
        "broken_jsonl": write("broken.jsonl", '{"question": "1 + 1", "answer": "2"}\n{"question": \n'),
        "csv": write("data.csv", "question,answer\n"),
        "pretrain_bad_row": write("texts.jsonl", json.dumps({"txt": "no text field"}) + "\n"),
        "pair_rows": write(
            "pairs.jsonl",
            "".join(
                json.dumps(r) + "\n"
                for r in [
                    {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 3"},
                    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 4"},
                ]
            ),
        ),
    }


# (argv builder, fragment of the expected message); every case must fail before any training starts
GRPO_CASES = {
    "unknown key override": (lambda f: [str(GRPO_TINY), "rl.bogus=1"], "unknown key 'rl.bogus'"),
    "unknown key in a file": (lambda f: [f["unknown_key"]], "unknown key 'rl.num_generation': did you mean"),
    "bad enum": (lambda f: [str(GRPO_TINY), "rl.algorithm=ppo"], "rl.algorithm"),
    "bad type": (lambda f: [str(GRPO_TINY), "train.steps=abc"], "train.steps"),
    "negative": (lambda f: [str(GRPO_TINY), "train.steps=-1"], "train.steps: Input should be greater than 0"),
    "missing config file": (lambda f: ["no/such/config.yml"], "config file not found: no/such/config.yml"),
    "yaml syntax": (
        lambda f: [f["syntax"]],
        "syntax.yml:4:3: YAML syntax error: expected ',' or ']', but got ':' (while parsing a flow sequence at line 3)",
    ),
    "empty yaml": (lambda f: [f["empty"]], "empty.yml: the file is empty"),
    "duplicate key": (lambda f: [f["duplicate"]], "duplicate.yml:3: duplicate key 'steps' (first at line 2)"),
    "top-level list": (lambda f: [f["list"]], "list.yml: the top level must be a mapping of sections, got a YAML list"),
    "scalar section": (lambda f: [f["scalar_section"]], "train: Input should be a valid dictionary"),
    "override without =": (lambda f: [str(GRPO_TINY), "train.steps"], "is not of the form dotted.key=value"),
    "empty key component": (lambda f: [str(GRPO_TINY), "rl..beta=1"], "has an empty key component"),
    "override into a value": (lambda f: [str(GRPO_TINY), "rl.loss.beta.x=1"], "'beta' is a value, not a section"),
    "override not yaml": (lambda f: [str(GRPO_TINY), "rl.loss.beta=[1,"], "the value is not valid YAML"),
    "missing base_config": (lambda f: [f["missing_base"]], "config file not found: no_such_base.yml"),
    "base_config cycle": (lambda f: [f["cycle_a"]], "base_config cycle"),
    "syntax error in a base": (lambda f: [f["bad_base"]], "syntax.yml:4:3: YAML syntax error"),
    "duplicate key in a base": (lambda f: [f["dup_base"]], "duplicate.yml:3: duplicate key 'steps'"),
    "missing policy path": (
        lambda f: [str(GRPO_TINY), "checkpoint.init_from=/no/such/policy"],
        "checkpoint.init_from: /no/such/policy does not exist",
    ),
    "missing data source": (
        lambda f: [str(GRPO_TINY), "data.source=/no/such/data.jsonl"],
        "data.source: /no/such/data.jsonl does not exist",
    ),
    "missing tokenizer": (
        lambda f: [str(GRPO_TINY), "data.tokenizer_dir=/no/such/tok"],
        "data.tokenizer_dir: /no/such/tok does not exist",
    ),
    "unknown reward": (
        lambda f: [str(GRPO_TINY), "reward.functions=[{fn: mathverify}]"],
        "reward.functions[0].fn: unknown reward function 'mathverify'",
    ),
    "missing reward file": (
        lambda f: [str(GRPO_TINY), "reward.functions=[{fn: /no/such/r.py:f}]"],
        "file /no/such/r.py does not exist",
    ),
    "max_tokens >= max_model_len": (
        lambda f: [str(GRPO_TINY), "rollout.max_tokens=128"],
        "rollout.max_tokens (128) must be < rollout.max_model_len (128)",
    ),
    "top_k 0": (lambda f: [str(GRPO_TINY), "rollout.top_k=0"], "rollout.top_k must be -1 (off) or >= 1"),
    "epsilon_high < epsilon": (
        lambda f: [str(GRPO_TINY), "rl.loss.epsilon_high=0.1"],
        "rl.loss.epsilon_high (0.1) must be >= rl.loss.epsilon (0.2)",
    ),
    "indivisible batch": (
        lambda f: [str(GRPO_TINY), "train.micro_batches=3", "train.batch_size=9"],
        "must be divisible by rl.batch.mini_batches * train.micro_batches (1 * 3 = 3)",
    ),
    "async with jax": (
        lambda f: [str(GRPO_TINY), "rl.off_policy_steps=1", "rollout.sampler=jax"],
        "needs rollout.sampler=vllm",
    ),
    "gqa heads": (lambda f: [str(GRPO_TINY), "model.num_kv_heads=3"], "model.num_heads (4) must be a multiple"),
    "malformed row": (
        lambda f: [str(GRPO_TINY), f"data.source={f['bad_row']}", f"data.tokenizer_dir={f['tok']}"],
        "bad_row.jsonl: row 1: field 'question' (used by rl.prompt_template) is missing",
    ),
    "unreadable jsonl": (
        lambda f: [str(GRPO_TINY), f"data.source={f['broken_jsonl']}", f"data.tokenizer_dir={f['tok']}"],
        "broken.jsonl': cannot be read as json",
    ),
    "unsupported data file": (
        lambda f: [str(GRPO_TINY), f"data.source={f['csv']}", f"data.tokenizer_dir={f['tok']}"],
        "unsupported file type '.csv'",
    ),
}

PRETRAIN_CASES = {
    "mesh does not fit": (lambda f: ["mesh.tensor=3"], "does not divide the 8 available devices"),
    "unknown preset": (lambda f: ["model.preset=gpt5"], "unknown model preset 'gpt5'"),
    "missing hf config": (lambda f: ["model.hf_config=/no/such/model"], "Hugging Face config not found"),
    "missing init_from": (lambda f: ["checkpoint.init_from=/no/such/run"], "checkpoint.init_from: /no/such/run"),
    "vocabulary too small": (
        lambda f: [f"data.tokenizer_dir={f['tok']}", "data.num_examples=100", "model.vocab_size=64"],
        "model.vocab_size (64) is smaller than the tokenizer",
    ),
    "malformed text row": (
        lambda f: [f"data.source={f['pretrain_bad_row']}", f"data.tokenizer_dir={f['tok']}"],
        "texts.jsonl: row 0: field 'text'",
    ),
}


DPO_CASES = {
    "identical chosen and rejected": (
        lambda f: [f"data.source={f['pair_rows']}", "data.columns={}", f"data.tokenizer_dir={f['tok']}"],
        "pairs.jsonl: row 1: chosen and rejected are identical",
    ),
    "text rows are not pairs": (
        lambda f: ["data.format=text"],
        "DPO reads data.format=prompt_completion (prompt",
    ),
    "unknown loss": (lambda f: ["dpo.loss_type=kto"], "dpo.loss_type"),
    "smoothing a loss without it": (
        lambda f: ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"],
        "loss_type 'ipo' has no label smoothing",
    ),
}


def _no_chat_template(tokenizer_dir: str, out: Path) -> str:
    """A copy of the tokenizer without its chat template."""
    import shutil

    shutil.copytree(tokenizer_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return str(out)


def _bf16_dump(out: Path) -> str:
    """A dump directory whose index says its log-probs are bfloat16 (what training reads first)."""
    out.mkdir()
    (out / "index.json").write_text(json.dumps({"header": {"dtype": "bfloat16", "temperature": 1.0}, "shards": []}))
    return str(out)


DISTILL_TINY = ROOT / "recipes" / "configs" / "distill_tiny.yml"
DPO_ONLINE_TINY = ROOT / "recipes" / "configs" / "dpo_online_tiny.yml"

# Refused at start: before a model, a teacher or a Ray cluster loads (the test makes each of those fail loudly).
START_CASES = {
    "compile-only distillation": (
        "recipes.distill",
        lambda f, t: [str(DISTILL_TINY), "train.compile_only=true"],
        "train.compile_only=true is not offered for distillation",
    ),
    "compile-only on-policy distillation": (
        "recipes.distill",
        lambda f, t: [str(DISTILL_TINY), "distill.regime=on_policy", "train.compile_only=true"],
        "train.compile_only=true is not offered for distillation",
    ),
    "compile-only online DPO": (
        "recipes.dpo",
        lambda f, t: [str(DPO_ONLINE_TINY), "train.compile_only=true"],
        "train.compile_only=true is not offered for online DPO",
    ),
    "compile-only dump": (
        "recipes.distill_logits",
        lambda f, t: [str(DISTILL_TINY), "train.compile_only=true", "distill.teacher=.", f"distill.logits_dir={t}"],
        "train.compile_only=true is not offered for the teacher's dump",
    ),
    "truncated sampling with the sampled-token loss": (
        "recipes.distill",
        lambda f, t: [str(GRPO_TINY), "distill.regime=on_policy", "distill.teacher=.", "rollout.top_p=0.9"],
        "rollout.top_p=0.9 / rollout.top_k=-1 that is the truncated distribution's",
    ),
    "top-k sampling with the sampled-token loss": (
        "recipes.distill",
        lambda f, t: [str(GRPO_TINY), "distill.regime=on_policy", "distill.teacher=.", "rollout.top_k=8"],
        "rollout.top_p=1.0 / rollout.top_k=8 that is the truncated distribution's",
    ),
    "chat template asked of a tokenizer without one": (
        "recipes.grpo",
        lambda f, t: [
            str(GRPO_TINY),
            "rl.use_chat_template=true",
            f"data.tokenizer_dir={_no_chat_template(f['tok'], t)}",
        ],
        "rl.use_chat_template=true, but the tokenizer in",
    ),
    "dump_k above the vocabulary": (
        "recipes.distill_logits",
        lambda f, t: [
            str(DISTILL_TINY),
            f"data.tokenizer_dir={f['tok']}",
            "distill.teacher=.",
            f"distill.logits_dir={t}",
            "distill.dump_k=100000",
        ],
        "distill.dump_k=100000 is above the vocabulary the top-k is taken over",
    ),
    "gkd top_k above the vocabulary": (
        "recipes.distill",
        lambda f, t: [
            str(GRPO_TINY),
            f"data.tokenizer_dir={f['tok']}",
            "distill.regime=on_policy",
            "distill.teacher=.",
            "distill.on_policy_loss=gkd",
            "distill.top_k=100000",
        ],
        "distill.top_k=100000 is above the vocabulary the top-k is taken over",
    ),
    "online top_k above the vocabulary": (
        "recipes.distill",
        lambda f, t: [
            str(DISTILL_TINY),
            f"data.tokenizer_dir={f['tok']}",
            "distill.regime=online",
            "distill.teacher=.",
            "distill.top_k=100000",
        ],
        "distill.top_k=100000 is above the vocabulary the top-k is taken over",
    ),
    "tail mode on a bfloat16 dump": (
        "recipes.distill",
        lambda f, t: [str(DISTILL_TINY), f"distill.logits_dir={_bf16_dump(t)}", "distill.top_k_mode=tail"],
        "distill.top_k_mode=tail with the bfloat16 dump",
    ),
}


@pytest.mark.parametrize("case", sorted(START_CASES))
def test_what_a_run_cannot_do_is_refused_before_anything_loads(case, files, capsys, tmp_path, monkeypatch):
    """Each of these once started a real run, or failed after Ray and the samplers had started: now one error
    line, before any model, teacher or cluster loads."""
    import core.checkpoint_models
    import posttrain.distill.teacher
    import rollout.ray

    def started(*args, **kwargs):
        raise AssertionError("a model, a teacher or Ray was started before the mistake was reported")

    for module, name in ((core.checkpoint_models, "initial_model"), (posttrain.distill.teacher, "load_teacher")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(rollout.ray, "ensure_ray", started)
    module, argv, fragment = START_CASES[case]
    rc, out, err = _run(module, [*argv(files, tmp_path / "made"), f"run.run_dir={tmp_path / 'run'}"], capsys)
    assert rc == 2, (out, err)
    assert "Traceback" not in err and err.startswith("error: ")
    assert fragment in err, err


def _run(module, argv, capsys):
    """(exit code, stdout, stderr from the error line on: library progress bars may precede it)."""
    import importlib

    recipe = importlib.import_module(module)
    rc = run_recipe(recipe.main, argv, recipe.__doc__, recipe.DEFAULT_CONFIG, module)
    out, err = capsys.readouterr()
    return rc, out, err[err.find("error: ") :] if "error: " in err else err


@pytest.mark.parametrize("case", sorted(GRPO_CASES))
def test_grpo_recipe_reports_the_users_mistake(case, files, capsys, tmp_path):
    argv, fragment = GRPO_CASES[case]
    rc, out, err = _run("recipes.grpo", [*argv(files), f"run.run_dir={tmp_path / 'run'}"], capsys)
    assert rc == 2, (out, err)
    assert "Traceback" not in err and err.startswith("error: ")
    assert fragment in err, err


@pytest.mark.parametrize("case", sorted(PRETRAIN_CASES))
def test_pretrain_recipe_reports_the_users_mistake(case, files, capsys, tmp_path):
    argv, fragment = PRETRAIN_CASES[case]
    rc, out, err = _run("recipes.pretrain", [*argv(files), f"run.run_dir={tmp_path / 'run'}"], capsys)
    assert rc == 2, (out, err)
    assert "Traceback" not in err and err.startswith("error: ")
    assert fragment in err, err


@pytest.mark.parametrize("case", sorted(DPO_CASES))
def test_dpo_recipe_reports_the_users_mistake(case, files, capsys, tmp_path):
    argv, fragment = DPO_CASES[case]
    rc, out, err = _run("recipes.dpo", [*argv(files), f"run.run_dir={tmp_path / 'run'}"], capsys)
    assert rc == 2, (out, err)
    assert "Traceback" not in err and err.startswith("error: ")
    assert fragment in err, err


@pytest.mark.parametrize("module", ["recipes.grpo", "recipes.pretrain", "recipes.hf_parity_demo"])
def test_every_recipe_answers_help_and_debug_shows_the_traceback(module, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    helped = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0 and f"usage: python -m {module} [CONFIG.yml] [key=value ...]" in helped.stdout
    assert "defaults to" in helped.stdout and "docs/config.md" in helped.stdout
    bad = [sys.executable, "-m", module, "train.steps=abc", f"run.run_dir={tmp_path / 'run'}"]
    plain = subprocess.run(bad, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "train.steps" in plain.stderr
    debug = subprocess.run([*bad, "--debug"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr
