"""The test session's JAX platforms (`tests/platforms.py`): the `gpu_only` tests can run where a GPU is."""

from tests.platforms import jax_platforms


def test_a_gpu_only_session_leaves_jax_to_find_the_gpu():
    assert jax_platforms("gpu_only", {}) is None
    assert jax_platforms("gpu_only and not serial", {}) is None


def test_every_other_session_runs_on_the_cpu():
    for markexpr in ("", "not serial", "serial", "not integration", "not gpu_only"):
        assert jax_platforms(markexpr, {}) == "cpu", markexpr


def test_a_platform_the_caller_set_is_kept():
    assert jax_platforms("", {"JAX_PLATFORMS": "cuda"}) is None
    assert jax_platforms("gpu_only", {"JAX_PLATFORMS": "cpu"}) is None


def test_this_session_runs_on_the_fake_cpu_devices():
    import jax

    assert jax.default_backend() == "cpu" and jax.device_count() == 8
