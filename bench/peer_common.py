"""What the peer scripts in the TRL venv share (bench/torch_sft_step.py, torch_dpo_step.py, trl_grpo_step.py,
trl_agent_step.py, trl_distill_step.py): their data, their TRL settings, their timing.

    ids, labels = completion_row(tok, prompt, completion, seq)   # prompt + completion + EOS, -100 on the prompt
    input_ids, attention, target = padded(seqs, labels, tok.pad_token_id)   # torch tensors, padded to the longest
    config = SFTConfig(**trl_arguments(args, "trl_sft"), ...)     # float32 on CPU, no logging, no saving
    config = GRPOConfig(**grpo_arguments(args, "trl_grpo_bench"), max_completion_length=...)  # a GRPO peer step
    config = DistillationConfig(**online_arguments(args, "trl_distill_bench"), beta=1.0, ...)  # a sampling peer
    trainer = SFTTrainer(..., callbacks=[step_timer(times)])       # each optimizer step timed
    write_result(out, times)                                        # first step apart, median / mean of the rest
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def completion_row(tok, prompt: str, completion: str, seq: int) -> tuple[list[int], list[int]]:
    """(token ids, labels) of prompt + completion + EOS cut to `seq` tokens, labels -100 on the prompt."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return (p + c)[:seq], ([-100] * len(p) + c)[:seq]


def padded(seqs: list[list[int]], labels: list[list[int]], pad_id: int):
    """(input ids, attention mask, labels) as torch tensors, every row padded to the longest (labels with -100)."""
    import torch

    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return ids, attention, target


def trl_arguments(args, name: str) -> dict:
    """The TrainingArguments every peer run shares: `args.batch` rows a step, `args.steps + 1` steps, learning
    rate 1e-4, `args.seq` tokens, float32 (bf16 runs ~17x slower on this CPU), on CPU, no logging or saving.
    Gradient checkpointing is TRL's default (on: the backward pass recomputes each layer's forward) for mode
    `trl`, and off for mode `trl_no_ckpt`, which keeps activations as Temper's default `model.remat_policy` does."""
    return dict(
        gradient_checkpointing=args.mode != "trl_no_ckpt",
        output_dir=str(Path(args.out).parent / name),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps + 1,
        learning_rate=1e-4,
        max_length=args.seq,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
    )


def online_arguments(args, name: str) -> dict:
    """What the peers that sample during training share (TRL's GRPO and distillation trainers): `args.steps`
    steps of one update each, learning rate 1e-5, sampling at temperature 1, float32 on CPU, logged every step
    (the reward figures), no saving."""
    return dict(
        output_dir=f"/tmp/{name}",
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        temperature=1.0,
        dataloader_num_workers=0,
        seed=0,
    )


def grpo_arguments(args, name: str) -> dict:
    """The GRPOConfig the GRPO peer steps share: `online_arguments` with `args.prompts_per_step` x
    `args.generations` completions a step and no KL (beta 0)."""
    return dict(
        online_arguments(args, name),
        per_device_train_batch_size=args.prompts_per_step * args.generations,
        num_generations=args.generations,
        beta=0.0,
    )


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
