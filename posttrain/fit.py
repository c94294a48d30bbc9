"""One entry for every method: `fit(cfg, method)` trains it to `train.steps`, resuming from `run.run_dir`.

    summary = fit(cfg, SFT)       # a dataset's batches: python -m recipes.sft CONFIG.yml
    summary = fit(cfg, GRPO)      # the samplers' batches: python -m recipes.grpo CONFIG.yml

Every method trains in the one run (`core.run.Run` over `core.train_loop.TrainLoop`); what differs is its batch
source. A method whose batches come from the samplers (`posttrain.onpolicy.method.SamplingMethod`: GRPO, PPO, online
DPO, on-policy distillation) reads `posttrain.onpolicy.source.SamplerSource` (built by
`posttrain.onpolicy.run.build_sampler_run`: samplers, rewards, the trainer, weight sync); any other reads its dataset
(`core.batch_source.DatasetSource`, built by `core.run.build_run`, its trainer in this process or a process group:
`posttrain.offline`). The run's workers are released however it ends.
"""

from __future__ import annotations

from typing import Any

from core.method import Method
from core.run import RunSummary

__all__ = ["RunSummary", "fit", "fit_or_compile"]


def fit(cfg: Any, method: Method) -> RunSummary:
    """Train `method` to `train.steps` (module docstring)."""
    from posttrain.onpolicy.method import SamplingMethod

    if isinstance(method, SamplingMethod):
        from posttrain.onpolicy.run import build_sampler_run

        return build_sampler_run(cfg, method).fit()
    from posttrain.offline import fit_offline

    return fit_offline(cfg, method)


def fit_or_compile(cfg: Any, method: Method) -> RunSummary | None:
    """`fit`; with `train.compile_only`, the method's update compiled for the configured mesh on fake CPU devices
    instead (`core.compile_only`: what it would take in memory, nothing trained), and None."""
    if cfg.train.compile_only:
        from core.compile_only import compile_method, request_devices

        request_devices(cfg)  # fake CPU devices for the configured mesh, before JAX's first device query
        compile_method(cfg, method)
        return None
    return fit(cfg, method)
