"""Test setup: 8 fake CPU devices (set before JAX is imported), markers, tiny HF models."""

import atexit
import os
import shutil
import tempfile

# XLA's CPU backend with its code optimisations and new fusion emitters off: the tiny models' steps compile about
# 4x faster (0.8 s, not 3.3 s, for a 2-layer SFT step) and run a little slower, which the suite's few steps do not
# notice; the results are the same to the tolerances the tests check (the resume tests' losses to 1e-6 as well).
# Inherited by every subprocess and Ray worker the tests start (those that set a device count keep these).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += (
        " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        " --xla_cpu_use_fusion_emitters=false"
    )
# One persistent compilation cache for the session, inherited by the recipe subprocesses and Ray actors the
# tests start: a run, its killed twin and its resumption compile the same programs once, not three times.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="temper-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")  # the fast compiles above are cached too
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest

from tests.platforms import jax_platforms


def pytest_configure(config):
    # JAX's platforms are chosen here, before any test module imports JAX: `-m gpu_only` leaves JAX to find a GPU.
    platforms = jax_platforms(config.getoption("markexpr") or "", os.environ)
    if platforms is not None:
        os.environ["JAX_PLATFORMS"] = platforms
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def _platforms() -> set[str]:
    import jax

    try:
        return {d.platform for d in jax.devices()}
    except RuntimeError:
        return set()


def pytest_collection_modifyitems(config, items):
    # The end-to-end tests first: xdist hands tests to its workers in this order, so the short ones fill the gaps
    # at the end, not one long test running alone while the other worker idles (longest first, roughly).
    items.sort(key=lambda item: "integration" not in item.keywords)
    platforms = _platforms()
    for item in items:
        if "gpu_only" in item.keywords and "gpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "tpu_only" in item.keywords and "tpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="needs a TPU"))
        if "cpu_only" in item.keywords and "cpu" not in platforms:
            item.add_marker(pytest.mark.skip(reason="CPU-only test"))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """Factory: (family, tied) -> path of a saved tiny random transformers model (cached per session)."""
    from core.tiny import save_tiny_hf_model

    cache: dict = {}

    def make(family: str, tied: bool = False):
        key = (family, tied)
        if key not in cache:
            cache[key] = save_tiny_hf_model(tmp_path_factory.mktemp(f"{family}_{tied}"), family, tied)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def arithmetic_tokenizer(tmp_path_factory):
    """A 512-token byte-level BPE tokenizer trained on generated arithmetic problems."""
    from core.sources import reasoning_gym_records
    from core.tokenizer import build_tokenizer

    texts = [r["text"] for r in reasoning_gym_records("basic_arithmetic", 300, seed=123)]
    return str(build_tokenizer(texts, tmp_path_factory.mktemp("tokenizer"), vocab_size=512))


@pytest.fixture(scope="session")
def rollout_model_dir(tmp_path_factory, arithmetic_tokenizer):
    """Factory: (family, seed) -> a tiny HF model directory with a tokenizer, servable by vLLM (hidden 128,
    head_dim 32: the CPU attention kernels need head_dim >= 32)."""
    import shutil
    from pathlib import Path

    from core.tiny import save_tiny_hf_model

    cache: dict = {}

    def make(family: str = "llama", seed: int = 0, tied: bool = False):
        key = (family, seed, tied)
        if key not in cache:
            path = save_tiny_hf_model(
                tmp_path_factory.mktemp(f"rollout_{family}_{seed}"),
                family,
                tied,
                seed=seed,
                hidden_size=128,
                head_dim=32,
            )
            for f in Path(arithmetic_tokenizer).iterdir():
                shutil.copy(f, path / f.name)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def teacher(rollout_model_dir):
    """A tiny random Qwen2 HF directory with the arithmetic tokenizer: the distillation tests' teacher (another init
    than the student's, so that there is a distance to close)."""
    return str(rollout_model_dir("qwen2", seed=1))
