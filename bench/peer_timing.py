"""Step timing shared by the peer scripts that run in the TRL venv (bench/torch_sft_step.py, torch_dpo_step.py).

times: list[float] = []
trainer = SFTTrainer(..., callbacks=[step_timer(times)])     # a TRL trainer: each optimizer step timed
write_result(out, times)                                      # first step apart, median / mean of the rest
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def step_timer(times: list[float]):
    """A transformers `TrainerCallback` appending each training step's seconds to `times`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.start)

    return StepTimer()


def write_result(out: str | Path, times: list[float]) -> None:
    """The timings as JSON: the first step (warm-up) apart, median and mean of the others, torch's version and
    thread count."""
    import torch

    steady = times[1:]
    result = {
        "first_step_s": times[0],
        "mean_step_s": statistics.mean(steady),
        "median_step_s": statistics.median(steady),
        "steps": len(steady),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    Path(out).write_text(json.dumps(result))
