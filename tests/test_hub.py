"""Models and datasets by Hugging Face Hub id, resolved by `huggingface_hub` and `datasets` through a cache laid out
as `huggingface_hub` lays it out (blobs, snapshots linking to them, refs), offline (HF_HUB_OFFLINE=1, set for the
whole suite): there is no network here, so the download path itself is not exercised."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.errors import MissingPath

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODEL_ID, DATASET_ID = "temper-tests/tiny-qwen2", "temper-tests/pairs"


def lay_out(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes]) -> Path:
    """A repository in the cache as `huggingface_hub` writes one: each file's content in `blobs/<sha256>`, the
    snapshot of a commit as relative links to the blobs, `refs/main` naming the commit."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_hf_dir, arithmetic_tokenizer):
    """A Hub cache holding a tiny Qwen2 model (with a tokenizer) and a preference dataset with two subsets."""
    from huggingface_hub import constants

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    model_files = {f.name: f.read_bytes() for f in Path(tiny_hf_dir("qwen2")).iterdir() if f.is_file()}
    model_files |= {f.name: f.read_bytes() for f in Path(arithmetic_tokenizer).iterdir() if f.is_file()}
    lay_out(cache, "model", MODEL_ID, model_files)

    import pandas as pd

    def parquet(rows) -> bytes:
        path = tmp_path / "rows.parquet"
        pd.DataFrame(rows).to_parquet(path)
        return path.read_bytes()

    rows = [{"question": f"What is {i} + 1?", "good": f" {i + 1}", "bad": f" {i + 2}"} for i in range(12)]
    readme = (
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: test\n    path: data/test-*\n- config_name: small\n  data_files:\n  - split: train\n"
        "    path: small/train-*\n---\n"
    )
    lay_out(
        cache,
        "dataset",
        DATASET_ID,
        {
            "README.md": readme.encode(),
            "data/train-00000-of-00001.parquet": parquet(rows[:10]),
            "data/test-00000-of-00001.parquet": parquet(rows[10:]),
            "small/train-00000-of-00001.parquet": parquet(rows[:3]),
        },
    )
    monkeypatch.chdir(tmp_path)  # no local path of the ids' names, unless a test makes one
    return cache


def test_a_model_by_hub_id_loads_from_the_cache(hub, tiny_hf_dir):
    from core.checkpoint_models import load_model_from
    from core.hf.directory import load_hf
    from core.hf.hub import resolve_model
    from core.tokenizer import tokenizer_for_run

    path = resolve_model(MODEL_ID)
    assert path == hub / "models--temper-tests--tiny-qwen2" / "snapshots" / COMMIT
    ours = load_model_from(MODEL_ID)
    reference, _ = load_hf(tiny_hf_dir("qwen2"))
    tokens = np.arange(1, 17, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(ours(tokens)), np.asarray(reference(tokens)))
    assert tokenizer_for_run(None, [], hub / "run", 512, init_from=MODEL_ID) == str(path)  # its own tokenizer


def test_a_local_path_wins_over_a_hub_id(hub, tiny_hf_dir):
    from core.hf.hub import resolve_model

    local = Path(MODEL_ID)
    shutil.copytree(tiny_hf_dir("llama"), local)
    assert resolve_model(MODEL_ID) == local


def test_an_id_missing_from_the_cache_offline_is_a_clear_error(hub):
    from core.config_loader import load_config
    from core.hf.hub import resolve_dataset, resolve_model
    from posttrain.config import PostTrainConfig

    with pytest.raises(
        MissingPath, match=r"'temper-tests/absent': not a local path, and not in the Hugging Face cache"
    ):
        resolve_model("temper-tests/absent")
    with pytest.raises(MissingPath, match=r"data.source 'temper-tests/absent'.*HF_HUB_OFFLINE=1"):
        resolve_dataset("temper-tests/absent")
    # an id is not a missing path when the config loads (it is resolved when the run starts); a path is
    cfg = load_config(overrides=[f"checkpoint.init_from={MODEL_ID}"], schema=PostTrainConfig)
    assert cfg.checkpoint.init_from == MODEL_ID
    with pytest.raises(MissingPath, match="checkpoint.init_from: runs/a/absent does not exist"):
        load_config(overrides=["checkpoint.init_from=runs/a/absent"])  # a path: an id is org/name


def test_a_dataset_by_hub_id_with_split_subset_and_columns(hub):
    from core.config import DataConfig
    from core.sources import load_records

    base = dict(source=DATASET_ID, columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    train = load_records(DataConfig(**base))
    assert len(train) == 10 and train[3]["prompt"] == "What is 3 + 1?" and train[3]["chosen"] == " 4"
    assert [r["prompt"] for r in load_records(DataConfig(**base, split="test"))] == [
        "What is 10 + 1?",
        "What is 11 + 1?",
    ]
    assert len(load_records(DataConfig(**base, subset="small"))) == 3
    with pytest.raises(ValueError, match="Unknown split"):
        load_records(DataConfig(**base, split="validation"))


def test_dpo_from_a_hub_model_on_a_hub_dataset(hub):
    """The recipe's path: `checkpoint.init_from` and `data.source` both Hub ids, resolved through the cache; one DPO
    step trains and the run exports."""
    from core.config_loader import load_config
    from core.run import build_run
    from posttrain.config import PostTrainConfig
    from posttrain.dpo.offline import DPO

    cfg = load_config(
        Path(__file__).resolve().parents[1] / "recipes" / "configs" / "dpo_tiny.yml",
        [
            f"run.run_dir={hub.parent / 'run'}",
            f"checkpoint.init_from={MODEL_ID}",
            f"data.source={DATASET_ID}",
            "data.columns={prompt: question, chosen: good, rejected: bad}",
            "data.eval_fraction=0",
            "train.steps=1",
            "train.batch_size=4",
            "checkpoint.enabled=false",
            "logging.tensorboard=false",
        ],
        schema=PostTrainConfig,
    )
    run = build_run(cfg, DPO)
    assert run.cfg.model.family == "qwen2"  # the checkpoint's shape, not the config's
    assert run.fit().steps == 1
    rows = [json.loads(line) for line in (hub.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and np.isfinite(rows[-1]["loss"])
    assert (hub.parent / "run" / "hf" / "config.json").exists()


def test_grpo_from_a_hub_model_takes_its_tokenizer(hub):
    """The on-policy methods find their tokenizer as the offline ones do: `checkpoint.init_from` a Hub id, no
    `data.tokenizer_dir`, the snapshot's own tokenizer (one GRPO step, the JAX sampler in this process)."""
    from core.config_loader import load_config
    from posttrain.config import PostTrainConfig
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.run import build_sampler_run

    prompts = hub.parent / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "recipes" / "configs" / "grpo_tiny.yml",
        [
            f"run.run_dir={hub.parent / 'grpo'}",
            f"checkpoint.init_from={MODEL_ID}",
            f"data.source={prompts}",
            "rollout.sampler=jax",
            "reward.functions=[{fn: tests.reward_plugins:char_count}]",
            "rl.accuracy_fn=null",
            "train.steps=1",
            "checkpoint.enabled=false",
            "checkpoint.export_hf=false",
        ],
        schema=PostTrainConfig,
    )
    run = build_sampler_run(cfg, GRPO)
    try:
        assert run.tokenizer_dir == str(hub / "models--temper-tests--tiny-qwen2" / "snapshots" / COMMIT)
        assert run.train().policy_version == 1
    finally:
        run.close()
