"""Compile-only compiles the update each method trains with: the method's loss in the Learner's step, on a batch its
own builder made, with abstract parameters and optimizer state (`core.compile_only`)."""

from __future__ import annotations

import re

import jax
import pytest

from core.config_loader import load_config
from posttrain.config import PostTrainConfig

MESH = ["mesh.fsdp=4", "mesh.tensor=2", "train.micro_batches=2"]


def arguments_gib(line: str) -> float:
    return float(re.search(r"arguments ([\d.]+) GiB", line).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize("method", ["pretraining", "SFT", "DPO", "GRPO"])
def test_each_methods_update_compiles_on_abstract_parameters(method, capsys):
    """The preset's parameters and AdamW moments (3 x float32 of Qwen2.5-0.5B's shapes, 4 of its layers), sharded 8
    ways, are the arguments XLA counts per device (with the small batch); nothing of the model is allocated."""
    from core.compile_only import compile_method
    from core.models import abstract_model, param_count
    from core.pretrain import PRETRAINING
    from posttrain.dpo.offline import DPO
    from posttrain.grpo import GRPO
    from posttrain.sft import SFT

    shapes = ["data.seq_len=64", "train.batch_size=8", "rollout.max_model_len=64", "rollout.max_tokens=32"]
    model = ["model.preset=qwen2.5-0.5b", "model.num_layers=4"]
    cfg = load_config("core/configs/base.yml", [*MESH, *model, *shapes], schema=PostTrainConfig)
    state_gib = 3 * param_count(abstract_model(cfg.model)) * 4 / 8 / 2**30
    before = sum(x.nbytes for x in jax.live_arrays())
    line = compile_method(cfg, {"pretraining": PRETRAINING, "SFT": SFT, "DPO": DPO, "GRPO": GRPO}[method])
    printed = capsys.readouterr().out
    assert (
        f"compile-only: {method} step, qwen2.5-0.5b on mesh {{'data': 1, 'fsdp': 4, 'expert': 1, 'tensor': 2" in printed
    )
    assert 0.98 < arguments_gib(line) / state_gib < 1.05, line
    assert sum(x.nbytes for x in jax.live_arrays()) - before < 50e6  # the 2 GiB of weights were never allocated


def test_an_expert_parallel_moe_update_compiles_with_its_experts_split(capsys):
    """Qwen3-30B-A3B's shapes (2 of its 48 layers) on fsdp 2 x expert 4: the parameters and AdamW moments are split
    8 ways (the experts over the expert axis, the rest over fsdp where it divides), so the arguments per device are
    about an eighth of them."""
    from core.compile_only import compile_method
    from core.models import abstract_model, param_count
    from core.pretrain import PRETRAINING

    overrides = ["mesh.fsdp=2", "mesh.expert=4", "model.preset=qwen3-30b-a3b", "model.num_layers=2"]
    cfg = load_config("core/configs/base.yml", [*overrides, "data.seq_len=64", "train.batch_size=8"])
    state_gib = 3 * param_count(abstract_model(cfg.model)) * 4 / 8 / 2**30
    line = compile_method(cfg, PRETRAINING)
    assert "'expert': 4" in capsys.readouterr().out
    assert 0.98 < arguments_gib(line) / state_gib < 1.05, line
