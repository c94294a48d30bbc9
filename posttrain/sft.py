"""Supervised fine-tuning: the next-token loss on the completion or the assistant turns (`core.method.Method`).

    run = build_run(cfg, SFT)        # python -m recipes.sft CONFIG.yml [key=value ...]
    run.fit()

SFT is the core's next-token training (`core.pretrain.next_token_parts`: `core.losses.nll_loss` over a
`core.batch.PackedBatch`) on rows of two formats (`data.format`):

- `prompt_completion`: `prompt` and `completion` strings; the prompt as a model is given it (the tokenizer's BOS
  if it adds one), the completion and EOS after it (`core.encoding`); targets are the completion's tokens and EOS;
- `chat`: a `messages` list (system / user / assistant / tool turns, any number; `reasoning_content` or `thinking`
  fields ride along) rendered with the tokenizer's own chat template; targets are every assistant turn's tokens
  and its end-of-turn token, located in one rendering of the whole conversation (`core.chat`: any template the
  model families ship, without a hand-written training template).

`sft.completion_only_loss=false` trains on every token instead. Rows are packed (`data.packing`) several
conversations per row with attention kept inside each; the loss is the mean over the target tokens of the whole
global batch, so packing and micro-batching do not change the gradient. A row that cannot be used (a missing
field, a template that cannot render it, no target left after truncation to `data.seq_len` on
`data.truncation_side`) is an error naming it, or skipped and counted with `data.skip_malformed`.

At every evaluation (`train.eval_every`, on the `data.eval_fraction` of the usable rows held out) it logs the
held-out loss and perplexity over the targets, and the greedy completions of the first `sft.eval_generations`
held-out rows (`run_dir/generations.jsonl`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flax import nnx

from core.batch import PackedBatch
from core.data import Examples, load_tokenizer, messages_problem, string_fields_problem
from core.encoding import encode_completion, encode_prompt
from core.loop import Hook
from core.losses import nll_loss
from core.method import Method
from core.pretrain import full_rows_batch, next_token_parts
from core.run import MethodParts, RunContext, check_rows
from core.train import LossFn
from core.train_loop import TrainLoop
from core.trainer import Trainer
from posttrain.config import PostTrainConfig
from rollout.sampler import Prompt

# ------------------------------------------------------------------ rows


@dataclass(frozen=True)
class PromptCompletionRows:
    """`prompt` + `completion` strings: the prompt as a model is given it, then the completion and EOS."""

    completion_only: bool = True

    def problem(self, row: dict) -> tuple[str, str] | None:
        return string_fields_problem(row, ["prompt", "completion"])

    def tokenize(self, row: dict, tokenizer: Any) -> tuple[list[int], list[int]]:
        prompt = encode_prompt(tokenizer, row["prompt"])
        ids = prompt + encode_completion(tokenizer, row["completion"])
        first = len(prompt) if self.completion_only else 1
        return ids, list(range(max(first, 1), len(ids)))


@dataclass(frozen=True)
class ChatRows:
    """A `messages` conversation, rendered by the tokenizer's chat template; every assistant turn a target."""

    completion_only: bool = True

    def problem(self, row: dict) -> tuple[str, str] | None:
        return messages_problem(row)

    def tokenize(self, row: dict, tokenizer: Any) -> tuple[list[int], list[int]]:
        from core.chat import render_chat

        ids, targets = render_chat(tokenizer, row["messages"], row.get("tools"))
        return ids, targets if self.completion_only else list(range(1, len(ids)))


def row_format(data_format: str, completion_only: bool) -> PromptCompletionRows | ChatRows:
    return ChatRows(completion_only) if data_format == "chat" else PromptCompletionRows(completion_only)


# ------------------------------------------------------------------ held-out generations


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


def held_out_prompts(records: Sequence[dict], examples: Examples, data_format: str, n: int) -> list[tuple[Prompt, str]]:
    """(prompt, reference answer) of the first `n` rows of the held-out split that have one: rows the run never
    trains on, and never one it skipped as malformed."""
    held = (generation_prompt(records[i], data_format) for i in examples.eval)
    return [p for p in held if p is not None][:n]


def generation_hooks(run: RunContext, examples: Examples) -> Sequence[Hook]:
    """Greedy completions of the first `sft.eval_generations` rows of the held-out split at every evaluation."""
    cfg = run.cfg
    chosen = held_out_prompts(run.records, examples, cfg.data.format, cfg.sft.eval_generations)
    if not chosen or not cfg.train.eval_every:
        return []
    from core.chat_template import turn_stop_ids
    from rollout.sampler import SamplingParams

    # A chat reply ends where the template ends a turn (`core.chat.turn_stop_ids`), not only on EOS.
    stops = turn_stop_ids(load_tokenizer(run.tokenizer_dir)) if cfg.data.format == "chat" else ()
    params = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.sft.eval_max_new_tokens, stop_token_ids=stops)
    out = Path(cfg.run.run_dir) / "generations.jsonl"

    def generate(loop: TrainLoop, step: int) -> None:
        prompts = [p for p, _ in chosen]
        texts = loop.trainer.apply(greedy_completions, prompts, params, run.tokenizer_dir, cfg.data.seq_len * 2, step)
        with out.open("a") as f:
            for (prompt, reference), text in zip(chosen, texts):
                f.write(json.dumps({"step": step, "prompt": prompt, "reference": reference, "output": text}) + "\n")
        first = texts[0].replace("\n", "\\n")
        print(f"eval @ step {step}: greedy sample: {first[:120]!r} (all in {out.name})", flush=True)

    return [Hook("generations", cfg.train.eval_every, generate)]


def greedy_completions(
    trainer: Trainer, prompts: list[Prompt], params: Any, tokenizer_dir: str, max_model_len: int, version: int
) -> list[str]:
    """Where the trainer is (`core.trainer.Trainer.apply`; every process of a group takes part): the trained
    model's completions of `prompts`, from a JAX sampler on the trainer's mesh built at the first call (it compiles
    then) and kept. The parameters are read before the next update donates them."""
    from rollout.jax_sampler import JaxSampler

    sampler = trainer.kept.get("sft.generations")
    if sampler is None:
        sampler = JaxSampler(trainer.model(), tokenizer_dir, mesh=trainer.mesh, max_model_len=max_model_len)
        trainer.kept["sft.generations"] = sampler
    sampler.update_weights(nnx.state(trainer.model()), version=version)
    return [c.text for c in sampler.generate(prompts, params)]


# ------------------------------------------------------------------ the method


class SupervisedFineTuning(Method):
    name = "SFT"

    def check(self, cfg: PostTrainConfig) -> None:
        check_config(cfg)

    def tokenizer_texts(self, records: Sequence[dict]) -> Iterable[str]:
        for r in records:
            for name in ("prompt", "completion"):
                if isinstance(r.get(name), str):
                    yield r[name]
            for m in r.get("messages") or []:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    yield m["content"]

    def loss(self, cfg: PostTrainConfig) -> LossFn:
        return nll_loss

    def parts(self, run: RunContext) -> MethodParts:
        rows = row_format(run.cfg.data.format, run.cfg.sft.completion_only_loss)
        return next_token_parts(run, rows, hooks=lambda examples: generation_hooks(run, examples))

    def example_batch(self, cfg: PostTrainConfig, row_multiple: int) -> PackedBatch:
        # Full rows, the first half a prompt (no loss under sft.completion_only_loss): the targets compacted to
        # the completions' share, as the pipeline's batches are.
        return full_rows_batch(cfg, cfg.data.seq_len // 2 if cfg.sft.completion_only_loss else 0)


SFT = SupervisedFineTuning()


def check_config(cfg: PostTrainConfig) -> None:
    formats = {"chat": "a `messages` list", "prompt_completion": "`prompt`, `completion`"}
    check_rows(cfg, "SFT", formats, "; plain text is pretraining (python -m recipes.pretrain)")
