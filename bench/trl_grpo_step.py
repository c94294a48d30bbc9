"""TRL's GRPOTrainer step time on a model and prompt file, for bench/grpo_step.py (runs in the TRL venv).

    .venv-trl/bin/python bench/trl_grpo_step.py --model HF_DIR --prompts prompts.jsonl --steps 4 \
        --prompts-per-step 4 --generations 4 --max-tokens 16 --out result.json

Same work per step as a Temper step: prompts_per_step prompts x generations
completions of at most max_tokens tokens, the same reward (`--reward`, a function
of `bench/bench_rewards.py`), one optimizer update (no KL, beta =
0), float32 on CPU. The reward's mean and per-group spread are written with the
times (from TRL's per-step log), so a run can show that no step was a no-op. Generation is TRL's default
(transformers `generate`). Times every step with a callback; the first step
(warm-up) is reported separately.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reward", default="char_length", help="a function of bench/bench_rewards.py")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import sys

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_rewards
    from peer_common import grpo_arguments, step_timer

    reward_fn = getattr(bench_rewards, args.reward)

    torch.set_num_threads(torch.get_num_threads())
    rows = [json.loads(l) for l in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts, completions, **_):
        return reward_fn(prompts, completions)

    times: list[float] = []
    config = GRPOConfig(**grpo_arguments(args, "trl_grpo_bench"), max_completion_length=args.max_tokens)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_timer(times)],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    mean = lambda key: sum(h[key] for h in logs) / max(len(logs), 1)
    Path(args.out).write_text(
        json.dumps(
            {
                "step_times": times,
                "torch_threads": torch.get_num_threads(),
                "reward_mean": mean("reward"),
                "reward_std": mean("reward_std"),
                # share of groups whose rewards were all equal (zero advantages: nothing to learn from them)
                "frac_reward_zero_std": mean("frac_reward_zero_std"),
            }
        )
    )


if __name__ == "__main__":
    main()
