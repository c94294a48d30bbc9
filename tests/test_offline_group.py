"""An offline method on a trainer process group: SFT with 2 JAX processes x 4 CPU devices (Ray actors,
jax.distributed, gloo) trains step for step as 1 process x 8 devices does, and writes the run directory once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_sft import chats, qwen_chat  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.serial]


@pytest.fixture
def local_ray():
    from rollout.ray import ensure_ray

    ensure_ray(num_cpus=2)  # before anything imports Ray: a cluster on 127.0.0.1
    yield
    import ray

    ray.shutdown()


def sft_cfg(run_dir, source, tokenizer_dir, *overrides):
    from core.config_loader import load_config
    from posttrain.config import PostTrainConfig

    return load_config(
        "recipes/configs/sft_tiny.yml",
        [
            f"run.run_dir={run_dir}",
            f"data.source={source}",
            f"data.tokenizer_dir={tokenizer_dir}",
            "data.eval_fraction=0.05",
            "data.seq_len=96",
            "mesh.fsdp=4",
            "mesh.tensor=2",
            "optim.name=sgd",  # AdamW would amplify the two runs' different summation orders into visible noise
            "optim.learning_rate=0.1",
            "train.steps=4",
            "train.log_every=1",
            "train.eval_every=4",
            "checkpoint.every_steps=2",
            "logging.tensorboard=false",
            *overrides,
        ],
        schema=PostTrainConfig,
    )


def test_sft_on_two_processes_trains_as_one_process_and_writes_the_run_once(
    tmp_path,
    qwen_chat,  # noqa: F811
    local_ray,
    capsys,
):
    """The same SFT run in this process on 8 devices and on a group of 2 Ray actors x 4 devices: the same losses
    at every step and the same held-out loss (to float32 rounding: the two sum gradients in other orders), each
    step logged once, the generations (made where the trainer is: `Trainer.apply`) written once per evaluation, a
    Hugging Face export that loads, and each trainer process's output in its own log. The run itself (pipeline,
    loop, metrics) is this process's in both."""
    import torch
    import transformers

    from core.metrics import read_metrics
    from posttrain.fit import fit
    from posttrain.sft import SFT

    tokenizer_dir, _ = qwen_chat
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in chats(200, seed=3)))
    one = fit(sft_cfg(tmp_path / "one", source, tokenizer_dir), SFT)
    two = fit(
        sft_cfg(
            tmp_path / "two",
            source,
            tokenizer_dir,
            "placement.trainer_processes=2",
            "placement.cpu_devices_per_process=4",
        ),
        SFT,
    )
    assert one.steps == two.steps == 4
    rows = {name: read_metrics(tmp_path / name) for name in ("one", "two")}
    steps = {name: [r["step"] for r in rs if "loss" in r] for name, rs in rows.items()}
    assert steps["one"] == steps["two"] == [1, 2, 3, 4]  # each once: one process wrote the metrics
    for key in ("loss", "eval/loss"):
        a = [r[key] for r in rows["one"] if key in r]
        b = [r[key] for r in rows["two"] if key in r]
        assert a and len(a) == len(b), key
        # within 16 float32 steps of each value (measured: at most 0.6)
        np.testing.assert_allclose(b, a, rtol=16 * np.finfo(np.float32).eps, err_msg=key)
    assert [r["loss"] for r in rows["two"] if "loss" in r][-1] < rows["two"][0]["loss"]  # it trained

    generations = [json.loads(line) for line in (tmp_path / "two" / "generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in generations] == [4] * 4  # once, by the first process
    logs = tmp_path / "two" / "logs"  # each trainer process's output; the run's own is this process's
    assert (logs / "trainer-0.log").exists() and (logs / "trainer-1.log").exists()
    assert "step 4/4" in capsys.readouterr().out

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf", dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11]])
    with torch.no_grad():
        got, want = hf(ids).logits.numpy(), ref(ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * float(np.spacing(np.float32(np.abs(want).max()))))


def test_dpo_with_a_stored_reference_on_two_processes_resumes_exactly_after_kill_9(
    tmp_path, arithmetic_tokenizer, local_ray, capsys
):
    """DPO of LoRA adapters (with dropout: its keys come from the checkpointed RNG) with the reference (the policy
    with its adapters off) computed once and stored (every process computes them, process 0 writes the store,
    keyed on a digest made of each process's own shards) on 2 processes x 4 devices. One process gets SIGKILL after
    step 3 is logged (checkpoint 2 behind it): the group stops with `TrainerUnavailable`. The same config resumes
    from checkpoint 2 in a new group (the data's position from the processes' checkpoint: `core.trainer.Position`),
    reads the store back (the digest of the same weights on the same mesh is the
    same), redoes step 3 with the loss it logged before the kill and finishes step 4: every step logged once. The
    checkpoints hold the adapters alone. DPO's step itself equals one process's in tests/test_distributed.py."""
    import os
    import signal
    import threading
    import time

    import psutil

    from core.metrics import read_metrics
    from posttrain.dpo.offline import DPO
    from posttrain.fit import fit
    from posttrain.process_group import TrainerUnavailable
    from tests.test_dpo_run import dpo_config

    group = ["placement.trainer_processes=2", "placement.cpu_devices_per_process=4"]
    common = ["mesh.fsdp=4", "mesh.tensor=2", "optim.name=sgd", "optim.learning_rate=0.1", "train.log_every=1"]
    common += ["dpo.precompute_ref_logps=true", "checkpoint.every_steps=2", "logging.tensorboard=false"]
    common += ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"]
    cfg = dpo_config(tmp_path / "two", arithmetic_tokenizer, *common, *group, "train.steps=4")
    run_dir = tmp_path / "two" / "run"
    failure: dict = {}

    def first_run():
        try:
            fit(cfg, DPO)
        except Exception as err:  # the group's loss, seen by the driver
            failure["error"] = err

    thread = threading.Thread(target=first_run)
    thread.start()
    deadline = time.monotonic() + 600
    while not (
        (run_dir / "metrics.jsonl").exists() and any(r.get("step") == 3 for r in read_metrics(run_dir) if "loss" in r)
    ):
        assert thread.is_alive() and time.monotonic() < deadline, failure
        time.sleep(0.05)
    # the group's processes: Ray actors of posttrain.process_group.GroupProcess (their title names the class)
    pids = [p.pid for p in psutil.process_iter(["cmdline"]) if "GroupProcess" in " ".join(p.info["cmdline"] or [])]
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGKILL)
    thread.join(timeout=300)
    assert isinstance(failure.get("error"), TrainerUnavailable), failure
    before = [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]
    assert [s for s, _ in before][:3] == [1, 2, 3]
    store = run_dir / "reference_logps.npz"
    written = store.stat().st_mtime_ns

    assert fit(cfg, DPO).steps == 4  # a new group, from checkpoint 2
    after = [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]
    assert [s for s, _ in after] == [1, 2, 3, 4]  # each once: the killed run's step 3 was dropped and redone
    assert all(np.isfinite(loss) for _, loss in after) and after[1][1] < after[0][1]
    # step 3 redone exactly: the same loss to a float32 step or two of its value
    assert abs(after[2][1] - before[2][1]) <= 2 * np.spacing(np.float32(before[2][1]))
    assert store.stat().st_mtime_ns == written  # the same weights' digest: the store was read, not recomputed
    from tests.helpers import saved_tensors

    saved = saved_tensors(run_dir / "checkpoints" / "4")  # the adapters, not the base
    assert saved and all(p.endswith(("lora.a", "lora.b")) for p in saved), saved
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "reference_logps.npz: read" in log  # where the trainer is
    assert "resumed from" in capsys.readouterr().out  # the run's own output
