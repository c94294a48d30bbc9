"""Compile once (`core.compile_cache`, `core.goodput`): a second run of a recipe loads every executable from the
persistent cache, the clock tells waited, background and cached compilations apart, and goodput is the productive
share of the steps' wall time."""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from core.compile_cache import BACKGROUND_PREFIX, compile_clock, default_cache_dir, use_compile_cache
from core.goodput import Goodput, RunStart
from core.host_devices import with_host_device_count

ROOT = Path(__file__).resolve().parents[1]
COMPILED = re.compile(r"Finished XLA compilation of (\S+)")
LOADED = re.compile(r"Persistent compilation cache hit for '([^']+)'")


def pretrain(run_dir: Path, cache: str) -> tuple[subprocess.CompletedProcess, dict]:
    """A 3-step pretraining run of a one-layer model (checkpoint and export included) with JAX's compile log on; its
    run_info.json."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    env.update(JAX_LOG_COMPILES="1", XLA_FLAGS=with_host_device_count(os.environ.get("XLA_FLAGS", ""), 1))
    res = subprocess.run(
        [sys.executable, "-m", "recipes.pretrain", f"run.run_dir={run_dir}", "train.steps=3", "train.log_every=1",
         "data.num_examples=200", "data.seq_len=64", "model.num_layers=1", "model.hidden_size=64",
         "model.intermediate_size=128", "model.head_dim=16", f"compile.cache_dir={cache}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res, json.loads((run_dir / "run_info.json").read_text())


@pytest.mark.integration
def test_a_second_run_of_a_recipe_loads_every_executable_from_the_cache(tmp_path):
    """The same recipe twice into fresh run directories: the first compiles (no cache hit), the second finds every
    executable it compiles in the cache (JAX's compile log: each XLA compilation is a cache hit; the run's summary
    and every step's metrics: no XLA compilation); both record their time to the first step and goodput. How much
    time the cache saves is the benchmarks' to say (docs/benchmarks.md): under a loaded CI machine, loading 25
    executables has taken 40% of compiling them."""
    cache = tmp_path / "cache"
    first, first_info = pretrain(tmp_path / "one", str(cache))
    second, second_info = pretrain(tmp_path / "two", str(cache))
    compiled = COMPILED.findall(first.stderr)
    assert compiled and not LOADED.findall(first.stderr)
    assert any(f.name.endswith("-cache") for f in cache.iterdir())
    again, loaded = COMPILED.findall(second.stderr), LOADED.findall(second.stderr)
    assert len(again) == len(loaded) > 0, (len(again), len(loaded))
    for info in (first_info, second_info):
        assert info["time"]["time_to_first_step_s"] > 0 and 0 < info["time"]["goodput"] <= 1
    first_time, second_time = first_info["time"], second_info["time"]
    assert first_time["run_compilations"] > 0 and second_time["run_compilations"] == 0, (first_time, second_time)
    assert second_time["run_cache_hits"] >= first_time["run_compilations"], (first_time, second_time)
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert all(r["compile/compilations"] == 0 for r in steps) and steps[0]["compile/cache_hits"] > 0


def test_the_clock_tells_waited_background_and_cached_compilations_apart(tmp_path, monkeypatch):
    """A program compiled in this thread counts as waited for, one compiled in a compile-ahead thread as background,
    the same program lowered again (a new function) as a cache load, and again with the cache off as a
    compilation."""
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    previous = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        use_compile_cache(str(tmp_path))
        clock = compile_clock()
        x = jnp.arange(7.0)
        before = clock.read()
        jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.25)(x).block_until_ready()
        waited = clock.read() - before
        assert waited.compiles == 1 and waited.cache_hits == 0 and waited.seconds > 0

        before = clock.read()
        jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.25)(x).block_until_ready()  # the same program: from the cache
        loaded = clock.read() - before
        assert loaded.compiles == 0 and loaded.cache_hits == 1

        before = clock.read()
        thread = threading.Thread(
            target=lambda: jax.jit(lambda v: jnp.cos(v) - 0.5).lower(x).compile(), name=f"{BACKGROUND_PREFIX}-test"
        )
        thread.start()
        thread.join()
        background = clock.read() - before
        assert background.compiles == 0 and background.seconds == 0
        assert background.background_compiles == 1 and background.background_seconds > 0

        use_compile_cache(None)  # `compile.cache_dir=null`: the same program compiles again
        before = clock.read()
        jax.jit(lambda v: jnp.sin(v) * 3.0 + 1.25)(x).block_until_ready()
        off = clock.read() - before
        assert off.compiles == 1 and off.cache_hits == 0
    finally:
        use_compile_cache(previous)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)  # the session's, for later tests


def test_the_default_cache_is_jaxs_variable_or_the_users_cache(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/jax")
    assert default_cache_dir() == "/somewhere/jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
    assert default_cache_dir() == "/home/u/.cache/temper/jax"


def test_goodput_is_the_productive_share_of_the_steps_wall_time():
    """Two steps of 2 s from t = 10 (the run began at 0), the first waiting 1.5 s for a compilation, 1 s of hooks
    between them: 2.5 s productive of 5 s."""
    meter = Goodput(RunStart(0.0))
    meter.step(2.0, 1.5, now=12.0)
    meter.step(2.0, 0.0, now=15.0)
    s = meter.summary()
    assert s["goodput"] == pytest.approx(0.5) and s["productive_s"] == pytest.approx(2.5)
    assert s["startup_s"] == pytest.approx(10.0) and s["time_to_first_step_s"] == pytest.approx(12.0)
    assert s["compile_s"] == pytest.approx(1.5) and "goodput 50.0%" in meter.line()


def test_a_process_that_exits_while_compiling_ahead_exits_cleanly():
    """A process whose background thread is inside XLA's compiler when it exits waits for that compilation (and
    drops the ones queued) instead of aborting in its daemon thread (exit code -6, 'FATAL: exception not
    rethrown', as a resumed run once did)."""
    script = """
import time, jax, jax.numpy as jnp
from core.compile_ahead import BackgroundCompiler
def step(x, w):
    for i in range(40):
        x = jnp.tanh(x @ w) + i
    return jax.grad(lambda x: (x @ w).sum())(x)
compiler = BackgroundCompiler("test")
for n in range(8, 200, 8):
    compiler.submit(lambda n=n: jax.jit(step).lower(jnp.ones((n, 64)), jnp.ones((64, 64))).compile())
time.sleep(0.3)
"""
    for _ in range(3):  # an exit between two compilations would not show it: three tries
        res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
