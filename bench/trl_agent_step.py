"""TRL's GRPOTrainer with a tool (`tools=`): its multi-turn step time, for bench/agent_step.py (runs in the TRL venv).

    .venv-trl/bin/python bench/trl_agent_step.py --model HF_DIR --prompts prompts.jsonl --steps 4 \
        --prompts-per-step 4 --generations 8 --max-turns 3 --max-tokens 48 --out result.json

The same work per step as Temper's agent step: prompts_per_step prompts x generations episodes; each turn the model
may call Temper's `calculator` (rollout/calculator.py, the same function, its JSON schema from transformers'
`get_json_schema` on both sides), TRL runs it and appends the result; at most `max_turns` model turns (TRL's
`max_tool_calling_iterations` = max_turns - 1) and `max_turns * max_tokens` completion tokens; the reward is
`bench_rewards.<--reward>` on the last turn (default `answer_closeness`); one optimizer update (beta = 0), float32
on CPU, generation with transformers `generate` (TRL's default). Temper's tokenizer writes calls as Qwen2.5 does
(`<tool_call>{...}</tool_call>`), so TRL reads them with its Qwen response template. Times every step with a
callback; the reward, its per-group spread, and TRL's tool-call counts are written with the times. With
`--environment` the calculator is a class in TRL's `environment_factory` shape (an instance per rollout, its public
method the tool) instead of `tools=`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="a turn's; the completion's budget is max_turns x this")
    p.add_argument("--reward", default="answer_closeness", help="a function of bench/bench_rewards.py")
    p.add_argument(
        "--environment",
        action="store_true",
        help="the calculator as an environment_factory class (one instance per rollout) instead of tools=",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_rewards
    from peer_common import grpo_arguments, step_timer

    from rollout.calculator import calculator  # plain Python: no Temper dependency is imported

    class CalculatorEnvironment:
        """The calculator in TRL's environment_factory shape (TRL makes one per rollout)."""

        def reset(self, **kwargs) -> str | None:
            return None

        def calculator(self, expression: str) -> str:
            return calculator(expression)

    # the function's own docstring: the same schema as tools= renders, and as the fine-tuning traces carried
    CalculatorEnvironment.calculator.__doc__ = calculator.__doc__

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]
    )

    times: list[float] = []
    config = GRPOConfig(
        **grpo_arguments(args, "trl_agent_bench"),
        max_completion_length=args.max_turns * args.max_tokens,
        max_tool_calling_iterations=args.max_turns - 1,
        gradient_checkpointing=False,  # TRL's default recomputes activations; Temper's step does not
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    tokenizer.response_template = qwen3_template  # Hermes-style calls, as Temper's template writes them
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=getattr(bench_rewards, args.reward),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        **({"environment_factory": CalculatorEnvironment} if args.environment else {"tools": [calculator]}),
        callbacks=[step_timer(times)],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    mean = lambda key: sum(h.get(key, 0.0) for h in logs) / max(len(logs), 1)
    Path(args.out).write_text(
        json.dumps(
            {
                "step_times": times,
                "torch_threads": torch.get_num_threads(),
                "reward_mean": mean("reward"),
                "reward_std": mean("reward_std"),
                "frac_reward_zero_std": mean("frac_reward_zero_std"),
                "tool_calls": mean("tools/call_frequency"),
                "tool_failures": mean("tools/failure_frequency"),
                "completion_length": mean("completions/mean_length"),
                "log_keys": sorted(logs[-1]) if logs else [],
            }
        )
    )


if __name__ == "__main__":
    main()
