"""The trainer's step as a JAX process group: 2 processes x 4 CPU devices (jax.distributed, gloo collectives)
take the step of 1 process x 8 devices, for each method's loss: pretraining, SFT (and SFT of LoRA adapters), DPO,
distillation (online: the teacher in the step) and GRPO (its policy learner's whole step), on an fsdp 4 x tensor 2
mesh, and a mixture-of-experts step with its experts split over an expert axis that spans both processes (expert 4
x tensor 2).
Before them, the collectives they rest on give known answers (`tests/distributed_worker.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.distributed import free_port
from tests.helpers import assert_same_gradients

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"
METHODS = ("pretrain", "sft", "sft_lora", "dpo", "distill", "grpo", "moe")


@pytest.mark.integration
@pytest.mark.serial  # three JAX processes of their own: one at a time beside the rest of the suite
def test_two_processes_of_four_devices_take_the_one_process_step_of_every_method(tmp_path):
    port = free_port("127.0.0.1")
    runs = [(tmp_path / "one.npz", 1, 0, 0)] + [(tmp_path / "two.npz", 2, i, port) for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), str(n), str(i), str(p)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out, n, i, p in runs
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    assert "process 1 of 2" in outputs[2]
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(one.files) == sorted(two.files)
    for method in METHODS:
        # Losses are means of terms of order 1 (GRPO's, ~0.01, sums advantages of both signs): within 8 float32
        # steps of max(1, |loss|). Measured: at most 0.2 steps.
        a, b = float(one[f"{method}/loss"]), float(two[f"{method}/loss"])
        assert abs(a - b) <= 8 * np.finfo(np.float32).eps * max(1.0, abs(a)), (method, a, b)
        names = sorted(k for k in one.files if k.startswith(f"{method}/grad/"))
        assert len(names) > 10, method
        # Measured: at most 18 float32 steps of a tensor's largest entry (the two sum in other orders).
        assert_same_gradients([one[k] for k in names], [two[k] for k in names], steps=32.0)
