"""Supervised fine-tuning: next-token loss on the completion or the assistant turns, on the shared skeleton.

    summary = run_sft(cfg)        # python -m recipes.sft CONFIG.yml [key=value ...]

SFT is the supervised core (`core.supervised`: the `core.learner.Learner`
with `core.losses.nll_loss` over a `core.batch.PackedBatch`, in the
`core.loop.Trainer`) on rows of two formats (`data.format`):

- `prompt_completion`: `prompt` and `completion` strings; targets are the
  completion's tokens and EOS;
- `chat`: a `messages` list (system / user / assistant, any number of turns)
  rendered with the tokenizer's own chat template; targets are every
  assistant turn's tokens and its end-of-turn token (`core.chat`).

`sft.completion_only_loss=false` trains on every token instead. Rows are
packed (`data.packing`) several conversations per row with attention kept
inside each; the loss is the mean over the target tokens of the whole global
batch, so packing and micro-batching do not change the gradient. A row with
no target left (after truncation to `data.seq_len` on
`data.truncation_side`) is an error naming it, or skipped and counted with
`data.skip_malformed`.

At every evaluation (`train.eval_every`, on `data.eval_fraction` of the rows
held out) it logs the held-out loss and perplexity over the targets, and the
greedy completions of `sft.eval_generations` held-out prompts
(`run_dir/generations.jsonl`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from core.config import Config
from core.config_loader import ConfigError
from core.loop import Hook, Trainer
from core.supervised import SupervisedRun, run_supervised
from rollout.sampler import Prompt


def generation_prompt(row: dict, data_format: str) -> tuple[Prompt, str] | None:
    """(what to complete, the reference answer) of a held-out row: the prompt, or the conversation up to its
    last assistant turn (rendered by the sampler with a generation prompt); None when there is none."""
    if data_format == "prompt_completion":
        return row["prompt"], row["completion"]
    messages = row["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if not last:  # no assistant turn, or one with nothing before it
        return None
    return list(messages[:last]), messages[last]["content"]


def generation_hook(run: SupervisedRun) -> Sequence[Hook]:
    """Greedy completions of the first `sft.eval_generations` held-out prompts at every evaluation."""
    cfg = run.cfg
    chosen = [p for p in (generation_prompt(r, cfg.data.format) for r in run.eval_records) if p is not None]
    chosen = chosen[: cfg.sft.eval_generations]
    if not chosen or not cfg.train.eval_every:
        return []
    from rollout.jax_sampler import JaxSampler
    from rollout.sampler import SamplingParams

    sampler: list[JaxSampler] = []  # built on first use (compiles then)
    out = Path(cfg.run.run_dir) / "generations.jsonl"

    def generate(trainer: Trainer, step: int) -> None:
        if not sampler:
            sampler.append(
                JaxSampler(
                    trainer.learner.model(), run.tokenizer_dir, mesh=trainer.mesh, max_model_len=cfg.data.seq_len * 2
                )
            )
        # The learner's current parameters, read before its next update donates them.
        sampler[0].update_weights(trainer.learner.params, version=step)
        params = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.sft.eval_max_new_tokens)
        completions = sampler[0].generate([p for p, _ in chosen], params)
        with out.open("a") as f:
            for (prompt, reference), c in zip(chosen, completions):
                f.write(json.dumps({"step": step, "prompt": prompt, "reference": reference, "output": c.text}) + "\n")
        first = completions[0].text.replace("\n", "\\n")
        print(f"eval @ step {step}: greedy sample: {first[:120]!r} (all in {out.name})", flush=True)

    return [Hook("generations", cfg.train.eval_every, generate)]


def check_sft_config(cfg: Config) -> None:
    if cfg.data.format not in ("chat", "prompt_completion"):
        raise ConfigError(
            f"SFT trains on data.format=chat (a `messages` list) or prompt_completion (`prompt`, `completion`), "
            f"not {cfg.data.format!r}; plain text is pretraining (python -m recipes.pretrain)"
        )
    if cfg.data.source is None:
        raise ConfigError("SFT needs data.source (a local jsonl / parquet / arrow file or directory)")


def run_sft(cfg: Config) -> SupervisedRun:
    """Fine-tune to `train.steps` (resuming from `run.run_dir`); returns the finished run."""
    check_sft_config(cfg)
    return run_supervised(cfg, hooks=generation_hook)
