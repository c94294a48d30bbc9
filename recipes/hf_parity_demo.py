"""Core-engine demo: Hugging Face checkpoints in, identical logits, Hugging Face checkpoints out.

For each supported family (Llama with llama3 RoPE scaling, Qwen2, Qwen3,
Mistral) it builds a tiny random model with `transformers`, loads it into a
sharded Temper model, compares logits with transformers, exports it back with
`save_hf`, and reloads the export in transformers.

    python -m recipes.hf_parity_demo [CONFIG.yml] [key=value ...]
    python -m recipes.hf_parity_demo mesh.debug_sharding=true
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np

from core.compile_only import refuse
from core.config_loader import config_from_argv, save_config
from core.hf.directory import load_hf, save_hf
from core.mesh import make_mesh
from core.models.summary import parameter_summary
from core.tiny import FAMILIES, save_tiny_hf_model

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "hf_parity_demo.yml"


def transformers_logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def main(argv: list[str]) -> int:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = config_from_argv(argv, DEFAULT_CONFIG, num_devices=jax.device_count())
    refuse(cfg, "the parity demo (it trains nothing)", "leave train.compile_only unset")
    run_dir = Path(cfg.run.run_dir)
    save_config(cfg, run_dir)
    mesh = make_mesh(cfg.mesh)
    print(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)")

    tokens = np.random.RandomState(cfg.run.seed).randint(0, 512, (2, 48))
    print(f"{'family':<8} {'tied':<5} {'|temper - transformers|':>24} {'|export - source|':>18}  time")
    worst = 0.0
    for family in FAMILIES:
        for tied in (False, True):
            start = time.perf_counter()
            src = save_tiny_hf_model(run_dir / f"{family}-tied{int(tied)}" / "source", family, tied)
            ref = transformers_logits(src, tokens)
            model, model_cfg = load_hf(src, mesh=mesh)
            if cfg.mesh.debug_sharding and family == FAMILIES[0] and not tied:
                print(parameter_summary(model))
            ours = np.asarray(model(tokens.astype(np.int32)))
            export = save_hf(model, model_cfg, src.parent / "export")
            back = transformers_logits(export, tokens)
            d1, d2 = np.abs(ours - ref).max(), np.abs(back - ref).max()
            worst = max(worst, d1, d2)
            print(f"{family:<8} {tied!s:<5} {d1:>24.2e} {d2:>18.2e}  {time.perf_counter() - start:.1f}s")
    ok = worst <= 1e-4
    print(f"{'OK' if ok else 'MISMATCH'}: max |diff| {worst:.2e} (tolerance 1e-4); exports in {run_dir}/")
    return 0 if ok else 1


if __name__ == "__main__":
    from core.cli import run_recipe

    sys.exit(run_recipe(main, sys.argv[1:], __doc__, DEFAULT_CONFIG, "recipes.hf_parity_demo"))
