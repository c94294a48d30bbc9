"""The pretraining recipe end to end, its compile-only mode, and bad input."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.host_devices import with_host_device_count

ROOT = Path(__file__).resolve().parents[1]
# the suite's other XLA flags (tests/conftest.py), without a device count
WITHOUT_DEVICE_COUNT = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
)


def run_recipe(*args, env_extra=None, timeout=600):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "recipes.pretrain", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.integration
def test_pretrain_tiny_learns_and_exports(tmp_path):
    res = run_recipe(
        f"run.run_dir={tmp_path}",
        "train.steps=20",
        "train.eval_every=10",
        "checkpoint.every_steps=10",
        "data.num_examples=1000",
        env_extra={"XLA_FLAGS": with_host_device_count(os.environ.get("XLA_FLAGS", ""), 1)},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    import json

    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    # A random model starts near ln(512) = 6.2 (every step is logged).
    assert losses[-1] < 0.6 * np.log(512) and losses[-1] < losses[0], losses
    assert "memory analysis: arguments" in res.stdout and "device memory in use" in res.stdout

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = tok("Calculate 2 + 3.\nAnswer:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()

    from core.hf.directory import load_hf

    ours, _ = load_hf(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(ours(ids.numpy().astype(np.int32))), logits.numpy(), atol=1e-4)


@pytest.mark.integration
def test_compile_only_on_fake_devices(tmp_path):
    cfg = tmp_path / "big.yml"
    # The preset's shapes with 4 of its 24 layers: the step compiles in seconds, not half a minute.
    cfg.write_text("base_config: base.yml\nmodel:\n  preset: qwen2.5-0.5b\n  num_layers: 4\n")
    res = run_recipe(
        str(cfg),
        "train.compile_only=true",
        "mesh.fsdp=4",
        "mesh.tensor=2",
        "data.seq_len=256",
        "train.batch_size=8",
        "train.micro_batches=2",
        env_extra={"XLA_FLAGS": WITHOUT_DEVICE_COUNT},  # compile-only asks for the devices its mesh needs
    )
    assert res.returncode == 0, res.stdout + res.stderr
    mesh = (
        "on mesh {'data': 1, 'fsdp': 4, 'expert': 1, 'tensor': 2, 'sequence': 1}, "
        "8 packed rows x 256 tokens in 2 micro-batch"
    )
    assert f"compile-only: pretraining step, qwen2.5-0.5b {mesh}" in res.stdout
    line = next(l for l in res.stdout.splitlines() if l.startswith("memory analysis"))
    args_gib = float(line.split("arguments ")[1].split(" GiB")[0])
    # The float32 parameters (tied embedding 151936 x 896, 4 layers of 14.9M) and their 2 Adam moments, sharded 8
    # ways: 12 bytes a parameter over 8 devices, to the printed 3 decimals.
    params = 151936 * 896 + 4 * (896 * 896 * 2 + 896 * 128 * 2 + 896 + 128 * 2 + 3 * 896 * 4864 + 2 * 896) + 896
    assert abs(args_gib - params * 12 / 8 / 2**30) < 2e-3, (line, params)
    assert "step " not in res.stdout  # nothing ran


def test_bad_config_key_is_reported():
    res = run_recipe("train.stepz=3")
    assert res.returncode != 0 and "unknown key 'train.stepz'" in res.stderr and "steps" in res.stderr
