"""FLOPs accounting, the JSONL/TensorBoard logger, and `python -m core.metrics compare`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import LoggingConfig, ModelConfig
from core.metrics import MetricsLogger, measure_matmul_peak, model_flops_per_token, read_metrics
from core.models import abstract_model, param_count

ROOT = Path(__file__).resolve().parents[1]


def test_flops_per_token_is_6n_plus_attention():
    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    # N = all parameters that multiply activations: total minus norms (the tied embedding is the output matmul)
    n_total = param_count(abstract_model(cfg))
    n_norms = 2 * 2 * 64 + 64
    attention = 12 * 2 * 100 * 4 * 16
    assert model_flops_per_token(cfg, seq_len=100) == 6 * (n_total - n_norms) + attention


def test_measured_peak_is_positive():
    assert measure_matmul_peak(n=256, repeats=2) > 1e8


def test_logger_writes_and_truncates_on_resume(tmp_path):
    log = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), total_steps=10)
    for step in range(1, 7):
        log.log(step, {"loss": 10.0 - step}, console=False)
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert list((tmp_path / "tensorboard").iterdir())
    # a run killed after step 6 resumes from its checkpoint at step 4: steps 5-6 are redone
    log = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), total_steps=10, resume_step=4)
    log.log(5, {"loss": 0.5}, console=False)
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["loss"] == 0.5
    # an evaluation after the run (the loop closed its logger): appended, and a second close is harmless
    log.log(5, {"eval/pass@1": 0.25}, console=False)
    log.close()
    assert read_metrics(tmp_path)[-1] == {**read_metrics(tmp_path)[-1], "step": 5, "eval/pass@1": 0.25}


def fake_run(path: Path, losses, seconds, params):
    path.mkdir()
    rows = [
        {"step": i + 1, "loss": l, "tokens_per_s": 1000.0 / s, "step_seconds": s, "tflops_per_s": 0.01 / s, "mfu": 0.1}
        for i, (l, s) in enumerate(zip(losses, seconds))
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "run_info.json").write_text(
        json.dumps(
            {
                "param_count": params,
                "versions": {"jax": "0.10.2", "flax": "0.12.8"},
                "memory_after_first_step": "0.01 GiB",
            }
        )
    )


def test_compare_cli(tmp_path):
    fake_run(tmp_path / "linen", [3.0, 2.0, 1.5], [0.2, 0.2, 0.2], 1000)
    fake_run(tmp_path / "nnx", [3.0, 1.9, 1.25], [0.1, 0.1, 0.1], 1000)
    out_html = tmp_path / "cmp.html"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.metrics",
            "compare",
            str(tmp_path / "linen"),
            str(tmp_path / "nnx"),
            "--out",
            str(out_html),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    lines = {
        l.split()[0] + (" " + l.split()[1] if l.startswith("final") else ""): l
        for l in res.stdout.splitlines()
        if l.strip()
    }
    assert "1.5" in lines["final loss"] and "1.25" in lines["final loss"] and "-0.25" in lines["final loss"]
    assert "10,000" in lines["tokens/s"] or "1e+04" in lines["tokens/s"]
    assert "0.2" in lines["s/step"] and "-0.1" in lines["s/step"]
    page = out_html.read_text()
    assert "data:image/png;base64," in page and "linen" in page and "nnx" in page


def test_compare_missing_run(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "core.metrics", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "metrics.jsonl not found" in res.stderr and "Traceback" not in res.stderr


def test_a_last_line_cut_short_by_a_kill_does_not_stop_resume_or_compare(tmp_path):
    fake_run(tmp_path / "a", [3.0, 2.0, 1.5], [0.2, 0.2, 0.2], 1000)
    fake_run(tmp_path / "b", [3.0, 1.9, 1.25], [0.1, 0.1, 0.1], 1000)
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1.1, "tokens_')  # killed mid-write
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.metrics",
            "compare",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            str(tmp_path / "c.html"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "metrics.jsonl:4: the last line is cut short" in res.stderr and "1.25" in res.stdout
    log = MetricsLogger(tmp_path / "b", LoggingConfig(tensorboard=False), total_steps=10, resume_step=3)
    log.log(4, {"loss": 1.0}, console=False)
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "b")][-2:] == [(3, 1.25), (4, 1.0)]


def test_a_corrupt_line_inside_the_file_is_named(tmp_path):
    from core.metrics import CorruptMetrics

    fake_run(tmp_path / "a", [3.0, 2.0, 1.5], [0.2, 0.2, 0.2], 1000)
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (tmp_path / "a" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptMetrics, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path / "a")
