"""Exact resume: SIGKILL a training process after a checkpoint, restart it on the same run directory.

The worker fine-tunes on chat rows (SFT: assistant-only targets, packed conversations); pretraining runs the
same loop, learner and pipeline on text rows; distillation trains a whole student from a teacher's dump. (DPO's
exact resume, of LoRA adapters with dropout and a stored reference, runs on a process group in
tests/test_offline_group.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.host_devices import with_host_device_count

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_worker.py"
OVERRIDES = [
    "train.steps=24",
    "train.log_every=1",
    "train.eval_every=0",
    "train.batch_size=4",
    "data.num_examples=800",
    "data.eval_fraction=0",
    "data.format=chat",
    "data.seq_len=128",
    "data.skip_malformed=true",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.head_dim=16",
    "checkpoint.every_steps=8",
    "checkpoint.async_save=true",
    "checkpoint.export_hf=false",
    "logging.tensorboard=false",
    "logging.peak_tflops=1.0",
]


# Offline distillation: the student reads a teacher's top-k dump (written by the test first) batch by batch.
DISTILL_OVERRIDES = [
    "--distill",
    "train.steps=24",
    "train.log_every=1",
    "train.eval_every=0",
    "train.batch_size=4",
    "data.num_examples=200",
    "data.eval_fraction=0",
    "data.format=chat",
    "data.seq_len=128",
    "distill.temperature=2.0",
    "distill.alpha=0.5",
    "distill.alpha_end=0.0",
    "distill.alpha_schedule=cosine",
    *OVERRIDES[9:],
]


def start(run_dir: Path, ids: Path, tokenizer: str, overrides: list[str] = OVERRIDES) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": with_host_device_count(os.environ.get("XLA_FLAGS", ""), 1)}
    head = overrides[:1] if overrides[:1] == ["--distill"] else []
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(ids), tokenizer, *head, f"run.run_dir={run_dir}", *overrides[len(head) :]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every logged training row, in file order: a duplicated step shows."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def id_records(path: Path) -> list[tuple[int, list[int]]]:
    """(step, example ids) of every batch the worker trained on, in order, across the kill and the resume."""
    return [(r["step"], r["ids"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.integration
@pytest.mark.parametrize("method", ["sft", "distill"])
def test_sigkill_then_resume_is_exact(tmp_path, arithmetic_tokenizer, rollout_model_dir, method):
    overrides, steps, rows = {"sft": (OVERRIDES, 24, 800), "distill": (DISTILL_OVERRIDES, 24, 200)}[method]
    if method == "distill":  # the teacher's top-k, dumped once for both runs (the dump is a recipe of its own)
        from recipes.distill_logits import main as dump

        topk = f"distill.logits_dir={tmp_path / 'topk'}"
        teacher = f"distill.teacher={rollout_model_dir('qwen2', seed=1)}"
        overrides = [*overrides, topk]
        settings = [o for o in overrides[1:] if o.startswith(("data.", "distill."))]
        assert (
            dump(["recipes/configs/distill_tiny.yml", *settings, teacher, f"data.tokenizer_dir={arithmetic_tokenizer}"])
            == 0
        )
    run_dir, run_ids = tmp_path / "run", tmp_path / "run_ids.jsonl"
    proc = start(run_dir, run_ids, arithmetic_tokenizer, overrides)
    deadline = time.time() + 300
    # wait until checkpoint 16 is committed and training has moved past it (step 17 logged, its batch for step 18
    # taken, so that a redone step has a loss to compare), then kill -9
    past = 18
    while not (
        (run_dir / "checkpoints" / "16").exists()
        and run_ids.exists()
        and id_records(run_ids)
        and id_records(run_ids)[-1][0] >= past
    ):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    losses_before_kill = losses(run_dir)
    before_kill = id_records(run_ids)
    killed_at = before_kill[-1][0]
    assert killed_at < steps, "the run finished before it could be killed"

    resumed = start(run_dir, run_ids, arithmetic_tokenizer, overrides)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    resumed_from = int(out.split("resumed from ")[1].split()[0].rsplit("/", 1)[1])
    assert 16 <= resumed_from < killed_at
    # The redone steps are checked against the killed run's own log (the same batches, the same losses): a step
    # redone from the checkpoint equals the step run before the kill only if the parameters, the optimizer state, the
    # RNG and the data position all came back. The steps after it follow from that state as an uninterrupted run's.
    got = losses(run_dir)
    assert [s for s, _ in got] == list(range(1, steps + 1))  # no gap, no repeat
    redone = [(s, v) for s, v in losses_before_kill if s > resumed_from]
    assert redone, "nothing to compare: the kill came right after the checkpoint"
    for step, a in redone:
        assert abs(a - got[step - 1][1]) <= 1e-6, (step, a, got[step - 1][1])
    run_records = id_records(run_ids)
    expected = list(range(1, killed_at + 1)) + list(range(resumed_from + 1, steps + 1))
    assert [s for s, _ in run_records] == expected
    redone_ids = {s: ids for s, ids in run_records[killed_at:]}
    assert all(redone_ids[s] == ids for s, ids in before_kill if s > resumed_from)  # the same examples
    trained = [i for _, ids in run_records[:resumed_from] + run_records[killed_at:] for i in ids]
    assert len(trained) == len(set(trained)) and all(0 <= i < rows for i in trained)  # first epoch: no repeats
