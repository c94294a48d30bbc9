"""The `make demo` job runs end to end and reports parity."""

import pytest

from recipes.hf_parity_demo import main


@pytest.mark.integration
def test_demo_runs_and_reports_parity(tmp_path, capsys):
    assert main([f"run.run_dir={tmp_path}", "mesh.debug_sharding=true"]) == 0
    out = capsys.readouterr().out
    assert "OK: max |diff|" in out and "total: " in out
    assert (tmp_path / "config.yaml").exists()
    assert (tmp_path / "qwen3-tied1" / "export" / "model.safetensors").exists()


def test_demo_rejects_unknown_key(tmp_path):
    from core.config_loader import ConfigError

    with pytest.raises(ConfigError, match="mesh.fsdpp"):
        main([f"run.run_dir={tmp_path}", "mesh.fsdpp=2"])
