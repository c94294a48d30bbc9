"""Distillation end to end on the tiny arithmetic task: the offline dump (resumable, checked against the data), the
offline and online regimes through `recipes.distill` (the held-out KL to the teacher goes down), the teacher in a
Ray actor of its own, and teachers refused at start (on-policy distillation: tests/test_distill_onpolicy_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.metrics import read_metrics
from tests.helpers import saved_tensors

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/configs/distill_tiny.yml"


def common(tmp_path, tokenizer, teacher, *extra):
    return [
        TINY,
        f"data.tokenizer_dir={tokenizer}",
        "data.num_examples=240",
        "data.eval_fraction=0.1",
        f"distill.logits_dir={tmp_path / 'topk'}",
        f"distill.teacher={teacher}",
        "distill.dump_rows_per_shard=64",
        "distill.dump_k=32",
        "logging.tensorboard=false",
        "sft.eval_generations=1",
        *extra,
    ]


def test_the_dump_resumes_and_refuses_other_data(tmp_path, arithmetic_tokenizer, teacher, capsys):
    from posttrain.distill.topk_store import TopKStoreMismatch, read_index
    from recipes.distill_logits import main as dump

    args = common(tmp_path, arithmetic_tokenizer, teacher, "distill.dump_dtype=bfloat16")
    assert dump(args) == 0
    topk = tmp_path / "topk"
    index = read_index(topk)
    assert [s["stem"] for s in index["shards"]] == [f"shard-{i:05d}" for i in range(4)]  # 240 rows / 64
    assert sum(s["rows"] for s in index["shards"]) == 240
    before = {p.name: p.read_bytes() for p in topk.glob("*.npy")}
    ids = np.load(topk / "shard-00001-ids.npy")
    logp = np.load(topk / "shard-00001-logp.npy")
    assert ids.shape[1] == 32 and logp.dtype == np.uint16  # bfloat16 bits
    as_f32 = (logp.astype(np.uint32) << 16).view(np.float32)
    assert (np.diff(as_f32, axis=1) <= 0).all() and (as_f32 < 0).all()  # most likely first, log-probs

    # A dump killed after shard 1: shards 2 and 3 are not in the index (their files may be half there).
    index["shards"] = index["shards"][:2]
    (topk / "index.json").write_text(json.dumps(index))
    (topk / "shard-00003-ids.npy").unlink()
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in topk.glob("shard-0000[01]-*.npy")}
    capsys.readouterr()
    assert dump(args) == 0
    assert "resuming the dump: 2 of 4 shards already written" in capsys.readouterr().out
    # a resume, not a rewrite: shards 0 and 1 are the very files the killed dump left; 2 and 3 written again
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in topk.glob("shard-0000[01]-*.npy")} == kept
    assert all((p.stat().st_ino, p.stat().st_mtime_ns) not in kept.values() for p in topk.glob("shard-0000[23]-*"))
    assert {p.name: p.read_bytes() for p in topk.glob("*.npy")} == before  # the same shards, exactly

    # Other targets behind the same directory (every token, not the assistant's): the first shard is named.
    with pytest.raises(TopKStoreMismatch, match=r"shard-00000: written for other data than this run's rows 0\.\.63"):
        dump([*args, "sft.completion_only_loss=false"])
    with pytest.raises(TopKStoreMismatch, match="made with seq_len=128, this run has 160"):
        dump([*args, "data.seq_len=160"])


def check_closer(run_dir: Path) -> list[float]:
    """The held-out forward KL(teacher || student) at T = 1 went down between the two evaluations; every step
    trained (finite, a non-zero gradient); the run exported."""
    rows = read_metrics(run_dir)
    evals = [r["eval/kl"] for r in rows if "eval/kl" in r]
    assert len(evals) == 2 and evals[1] < 0.95 * evals[0], evals
    train_rows = [r for r in rows if "loss" in r and "eval/loss" not in r]
    assert train_rows and all(r["skipped_steps"] == 0 and r["grad_norm"] > 0 for r in train_rows)
    assert (run_dir / "hf" / "config.json").exists()
    return evals


TRAIN = ["train.steps=14", "train.eval_every=7", "sft.eval_generations=0"]


def test_offline_distillation_brings_the_student_closer(tmp_path, arithmetic_tokenizer, teacher):
    """From the dump (renormalised top-32, forward KL), the teacher never loaded."""
    from recipes.distill import main as train
    from recipes.distill_logits import main as dump

    args = common(tmp_path, arithmetic_tokenizer, teacher, *TRAIN)
    assert dump(args) == 0
    assert train([*args, f"run.run_dir={tmp_path / 'offline'}"]) == 0
    print("offline", check_closer(tmp_path / "offline"))
    assert all(0 < r["teacher_mass"] <= 1 for r in read_metrics(tmp_path / "offline") if "teacher_mass" in r)


def test_online_distillation_brings_the_student_closer(tmp_path, arithmetic_tokenizer, teacher):
    """The teacher in the step, the whole vocabulary, JSD at T = 2 with a hard-label share, and a feature loss on
    two layer pairs through learned projections (student width 64, teacher 128) whose weight decays linearly:
    the feature distance goes down too, the projections are checkpointed and not exported."""
    from safetensors import safe_open

    from recipes.distill import main as train

    run_dir = tmp_path / "online"
    args = common(tmp_path, arithmetic_tokenizer, teacher, *TRAIN, f"run.run_dir={run_dir}")
    online = ["distill.regime=online", "distill.temperature=2.0", "distill.alpha=0.1", "distill.loss=jsd"]
    online.append("optim.learning_rate=3.0e-3")  # 14 steps of a random student: a faster rate than the recipe's
    features = ["distill.feature_layers=[[1,1],[2,2]]", "distill.feature_weight=1.0", "distill.feature_weight_end=0.2"]
    features += ["distill.feature_weight_schedule=linear", "distill.feature_loss=cosine", "train.log_every=1"]
    assert train([*args, *online, *features]) == 0
    print("online", check_closer(run_dir))
    feature = [r["feature"] for r in read_metrics(run_dir) if "feature" in r and "eval/loss" not in r]
    assert len(feature) >= 10 and np.mean(feature[-3:]) < 0.9 * np.mean(feature[:3]), feature
    latest = max((run_dir / "checkpoints").glob("[0-9]*"), key=lambda p: int(p.name))
    saved = saved_tensors(latest)  # the student and its projections: what trains, not the teacher
    assert any(p.startswith("projections.") for p in saved) and any(p.startswith("model.") for p in saved)
    assert not [p for p in saved if p.startswith("teacher")]
    with safe_open(str(next((run_dir / "hf").glob("*.safetensors"))), "np") as f:
        names = list(f.keys())
    assert names and not [n for n in names if "kernels" in n or "projection" in n]
    assert json.loads((run_dir / "hf" / "config.json").read_text())["hidden_size"] == 64

    # Refused at load: a feature loss where no teacher runs in the step.
    from core.config_loader import ConfigError

    with pytest.raises(ConfigError, match="only the online regime has"):
        train([*args, "distill.feature_layers=[[1,1]]", "distill.feature_weight=1.0", f"run.run_dir={run_dir}3"])


@pytest.mark.serial
def test_a_teacher_in_its_own_ray_actor_trains_as_the_teacher_in_the_step(
    tmp_path, arithmetic_tokenizer, teacher, capsys
):
    """distill.teacher_placement=actor: the teacher in a Ray actor of its own answers each batch (two micro-batches)
    with its top-16; three steps give the losses and KLs of the same run with the teacher in the step (top-16,
    renormalised), step by step. An actor that cannot start, does not answer in time or dies is an error that says
    so, naming the call (and, at start, the actor's own error); the actor is stopped when its run ends."""
    import time

    import psutil
    import ray

    from posttrain.config import PostTrainConfig
    from recipes.distill import main as train

    args = common(tmp_path, arithmetic_tokenizer, teacher, "train.steps=3", "train.eval_every=100")
    args += ["sft.eval_generations=0", "distill.regime=online", "distill.top_k=16", "train.micro_batches=2"]
    args += ["optim.learning_rate=3.0e-3", "distill.temperature=2.0", "train.log_every=1"]
    runs = {}
    for placement in ("beside", "actor"):
        run_dir = tmp_path / placement
        assert train([*args, f"distill.teacher_placement={placement}", f"run.run_dir={run_dir}"]) == 0
        runs[placement] = [r for r in read_metrics(run_dir) if "loss" in r and "eval/loss" not in r]
        out = capsys.readouterr().out
        assert ("in a Ray actor (cpu x" in out) == (placement == "actor"), out[-2000:]  # not a silent fallback
    assert [r["step"] for r in runs["actor"]] == [r["step"] for r in runs["beside"]] == [1, 2, 3]
    for a, b in zip(runs["actor"], runs["beside"], strict=True):
        # Step 1 from the same parameters; later steps after updates whose float32 rounding differs (the actor
        # takes its top-k at T = 1 on its own mesh, the step at T = 2 on the student's), grown by the updates.
        rel = 2e-5 if a["step"] == 1 else 3e-4
        for key in ("loss", "kl", "teacher_mass", "student_mass", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=rel), (a["step"], key, a[key], b[key])
    assert runs["actor"][0]["grad_norm"] > 0 and runs["actor"][-1]["loss"] < runs["actor"][0]["loss"]

    # The trainer stops the actor when the run ends (its attach is a `core.method.Served`), while the run is still
    # referenced (Ray would stop an actor whose handles are all gone anyway).
    from core.config_loader import load_config
    from core.run import build_run
    from posttrain.distill.method import DISTILL

    teachers = lambda: [
        p for p in psutil.process_iter(["cmdline"]) if "TeacherScorer" in " ".join(p.info["cmdline"] or [])
    ]
    one = [*args[1:], "distill.teacher_placement=actor", f"run.run_dir={tmp_path / 'ended'}", "train.steps=1"]
    before = {p.pid for p in teachers()}  # none, unless an earlier run's is still going away
    run = build_run(load_config(args[0], one, schema=PostTrainConfig), DISTILL)
    ours = {p.pid for p in teachers()} - before
    assert ours  # started with the trainer (its attach)
    run.fit()
    deadline = time.monotonic() + 30
    while ours & {p.pid for p in teachers()}:
        assert time.monotonic() < deadline, "the teacher's actor outlived its run"
        time.sleep(0.2)

    from posttrain.distill.remote_teacher import RemoteTeacher, TeacherUnavailable

    d = dict(regime="online", teacher=teacher, top_k=4, teacher_placement="actor", teacher_timeout_s=60)
    cfg = PostTrainConfig.model_validate({"distill": d})
    remote = RemoteTeacher.start(cfg, 512, "a test")
    assert "cpu" in remote.where
    from core.data import to_data_batch

    n, t = 2, 16
    tokens = np.random.RandomState(0).randint(3, 512, (n, t)).astype(np.int32)
    ones = np.ones((n, t), np.int32)
    rows = dict(tokens=tokens, segment_ids=ones, positions=np.tile(np.arange(t, dtype=np.int32), (n, 1)))
    packed = to_data_batch({**rows, "loss_mask": ones, "example_ids": 0 * ones}, 1).batch
    ids, logp = remote.score(packed, 1)
    assert ids.shape == logp.shape == (n, packed.target_ids.shape[1], 4) and (np.diff(logp, axis=-1) <= 0).all()
    remote.timeout_s = 1e-3  # a compiled pass takes longer than this
    with pytest.raises(TeacherUnavailable, match=r"unavailable during score\(\) \(GetTimeoutError"):
        remote.score(packed, 2)
    remote.timeout_s = 60
    ray.kill(remote.actor)
    with pytest.raises(TeacherUnavailable, match=r"the teacher actor is unavailable during score\(\)"):
        remote.score(packed, 1)

    from core.tiny import save_tiny_hf_model

    small = save_tiny_hf_model(tmp_path / "small", "qwen2", vocab_size=256)
    bad = PostTrainConfig.model_validate({"distill": {**d, "teacher": str(small)}})
    with pytest.raises(
        TeacherUnavailable, match=r"could not start: .*vocabulary of 256 rows, the student \(a test\) 512"
    ):
        RemoteTeacher.start(bad, 512, "a test")


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused_at_start(tmp_path, arithmetic_tokenizer):
    """A teacher with fewer vocabulary rows than the student, or with a tokenizer of its own that is not the run's
    (same size, other tokens): an error naming both, before any training or dumping."""
    import shutil

    from core.config_loader import ConfigError
    from core.tiny import save_tiny_hf_model
    from core.tokenizer import build_tokenizer
    from recipes.distill import main as train
    from recipes.distill_logits import main as dump

    small = save_tiny_hf_model(tmp_path / "small", "qwen2", vocab_size=256)
    args = common(tmp_path, arithmetic_tokenizer, str(small), "distill.regime=online", f"run.run_dir={tmp_path}/r")
    with pytest.raises(ConfigError, match="vocabulary of 256 rows, the student .* 512"):
        train(args)

    other = save_tiny_hf_model(tmp_path / "other", "qwen2", hidden_size=128, head_dim=32)
    words = [f"word{i} other{i * 7} text{i % 13}" for i in range(400)]
    for f in build_tokenizer(words, tmp_path / "other_tok", vocab_size=512).iterdir():
        shutil.copy(f, other / f.name)
    args = common(tmp_path, arithmetic_tokenizer, str(other), "distill.regime=online", f"run.run_dir={tmp_path}/o")
    pattern = rf"the teacher's tokenizer \({other}: \d+ tokens\) is not the student's \({arithmetic_tokenizer}"
    with pytest.raises(ConfigError, match=pattern):
        train(args)
    with pytest.raises(ConfigError, match=pattern):
        dump(args)
    assert not (tmp_path / "topk").exists()  # refused before writing anything
