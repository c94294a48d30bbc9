"""Multi-turn rollouts with the JAX sampler: token in / token out on shipped chat templates (Qwen2.5, Qwen3,
Llama 3.1), online DPO and on-policy distillation trained on whole trajectories, and agent configs refused before
anything starts. Async GRPO with an agent on vLLM is in tests/test_grpo_e2e.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollout.environment import Environment, EnvReply

# ------------------------------------------------------------------------------------------- token in / out


class Chatter(Environment):
    """Answers every turn with a user message until the third turn: multi-turn trajectories whatever the model says."""

    def reset(self, row):
        start = super().reset(row)
        start.state = 0
        return start

    def step(self, state, turn):
        if state >= 2:
            return EnvReply(reward=1.0, done=True, state=state)
        return EnvReply([{"role": "user", "content": f"Go on, step {state + 1}."}], reward=0.5, state=state + 1)


class Scorer(Chatter):
    """Chatter whose per-turn reward depends on what the model wrote (its length modulo 5): episodes of one row
    differ, so that a method that compares them (online DPO's best and worst) has pairs."""

    def step(self, state, turn):
        reply = super().step(state, turn)
        reply.reward = float(len(turn.content) % 5)
        return reply


def stopping_model(path, tokenizer, arch: str, share: float = 0.15, stop: str | None = None):
    """A tiny random `arch` model for `tokenizer` whose sampled turns end: its output row for `stop` (default EOS)
    points along the mean of its final hidden states after a chat prompt, scaled so that at half of those
    positions or more it has probability `share` or more (at temperature 1), so turns stop after a few tokens and
    the environment takes its turn."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.tiny import save_tiny_hf_model

    save_tiny_hf_model(path, arch, hidden_size=128, head_dim=32, max_position_embeddings=512, vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from core.chat import chat_prompt_ids

    prompt = torch.tensor([chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])] * 8)
    ids = torch.cat([prompt, torch.randint(3, len(tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))], 1)
    eos = tokenizer.convert_tokens_to_ids(stop) if stop else tokenizer.eos_token_id
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1][:, prompt.shape[1] - 1 :].reshape(-1, model.config.hidden_size)
        logits = out.logits[:, prompt.shape[1] - 1 :].reshape(h.shape[0], -1)
        rest = torch.logsumexp(torch.cat([logits[:, :eos], logits[:, eos + 1 :]], 1), -1)
        along = h @ h.mean(0)
        lo, hi = 0.0, 100.0
        for _ in range(50):  # the scale at which the median probability of EOS is `share`
            alpha = (lo + hi) / 2
            p = torch.sigmoid(alpha * along - rest).median()
            lo, hi = (alpha, hi) if p < share else (lo, alpha)
        model.lm_head.weight[eos] = alpha * h.mean(0)
    model.save_pretrained(path)
    return path


def assert_trained_tokens_carry_the_samplers_log_probs(turns, tok, model_path, tolerance: float) -> None:
    """Episodes of up to three turns on `turns` (temperature 1) with `Chatter`: the trainer's log-prob of every token
    the model produced, read from the trajectory as the trainer's batch holds it (prompt, turns and the template's
    tokens for the environment's messages in between), is the sampler's own within `tolerance`, token by token;
    the environment's tokens are not trained."""
    from rewards.pool import WorkerPool
    from rollout.environment import EnvironmentRunner
    from rollout.episodes import EpisodeLimits, run_episodes
    from rollout.sampler import SamplingParams
    from rollout.tool_parsing import ToolParsers

    pool = WorkerPool(1)
    try:
        env = EnvironmentRunner(f"{__file__}:Chatter", {}, pool, timeout_s=30.0)
        rows = [{"prompt": q} for q in ("What is 2 + 3?", "Add 10 and 7.", "Say hello.", "Count to three.")]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=24, seed=5)
        limits = EpisodeLimits(3, 24, 512)
        episodes = run_episodes(turns, env, tok, rows, limits, params, ToolParsers("hermes", tok))
    finally:
        pool.close()
    multi = [e for e in episodes if e.turns >= 2]
    assert multi and all(not all(e.sampled) for e in multi), [(e.turns, e.finish) for e in episodes]
    assert_completions_carry_the_samplers_log_probs([e.completion() for e in episodes], model_path, tolerance)


def assert_completions_carry_the_samplers_log_probs(completions, model_path, tolerance: float) -> None:
    """The trainer's log-prob of every sampled token of `completions`, read from the trainer's batch, is the
    sampler's own within `tolerance`; the other tokens are not trained."""
    from core.hf.directory import load_hf
    from core.targets import target_logprobs
    from posttrain.onpolicy.rl_batch import build_rl_batch

    longest = max(len(c.token_ids) for c in completions)
    batch = build_rl_batch(
        completions, np.zeros(len(completions)), np.ones(len(completions), bool), row_len=512, max_tokens=longest
    )
    model, _ = load_hf(model_path)
    trainer = np.asarray(target_logprobs(model, batch.packed, temperature=1.0, entropy=False)[0])
    gaps = []
    for i, c in enumerate(completions):
        own = np.asarray(c.sampled)
        got = trainer[i, : len(own)][own]
        want = np.asarray(c.logprobs)[own]
        assert np.all(np.asarray(batch.loss_mask)[i, : len(own)][~own] == 0)
        gaps.append(np.abs(got - want).max())
    # float32, the same weights, other summation orders (the sampler's decode steps, the trainer's packed rows).
    assert max(gaps) < tolerance, gaps


@pytest.mark.parametrize("family,arch", [("qwen2_5", "qwen2"), ("qwen3", "qwen3"), ("llama3_1", "llama")])
def test_every_trained_token_carries_the_samplers_own_log_prob(tmp_path_factory, tmp_path, family, arch):
    """The JAX sampler's slots (float32) on the family's shipped template."""
    from core.hf.directory import load_hf
    from rollout.jax_engine import SlotTurns
    from rollout.jax_sampler import JaxSampler
    from tests.test_chat import make_tokenizer

    tok = make_tokenizer(tmp_path_factory, family)
    path = stopping_model(tmp_path / "model", tok, arch)
    sampler = JaxSampler(load_hf(path)[0], tok.name_or_path, max_model_len=512, seed=0)
    assert_trained_tokens_carry_the_samplers_log_probs(SlotTurns(sampler, slots=4), tok, path, 1e-4)


CALL = '\n{"name": "calculator", "arguments": {"expression": "12 + 30"}}\n'  # one added token: the call's JSON


def scripted_model(path, tokenizer, arch: str, successors, scale: float = 60.0):
    """A tiny random `arch` model whose next token depends on the current token alone, by `successors` (a -> b, a
    dict or (a, b) pairs; a token may have several successors, and several tokens one): every layer's attention
    output and MLP down projection are zero, so the last hidden state is the token's own embedding, and b's output
    row points along the embeddings (after the final norm) of the tokens it follows. A deterministic agent at the
    default scale, served by any sampler from its Hugging Face files; a stochastic one at a small scale."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.tiny import save_tiny_hf_model

    save_tiny_hf_model(
        path, arch, hidden_size=128, head_dim=32, max_position_embeddings=2048, vocab_size=len(tokenizer)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        pairs = list(successors.items() if isinstance(successors, dict) else successors)
        for b in {b for _, b in pairs}:
            model.lm_head.weight[b] = 0.0
        for a, b in pairs:
            h = model.model.norm(model.model.embed_tokens.weight[a])
            model.lm_head.weight[b] += scale * h / h.norm() ** 2  # logit of b after a: ~`scale`; others ~N(0, 1)
    model.save_pretrained(path)
    return path


def calling_agent(tmp_path):
    """Qwen2.5's template with the Hermes call markers and the calculator call as added tokens, and a scripted
    model that answers every generation prompt with `<tool_call>`, the call, `</tool_call>`, EOS: (tokenizer, its
    model's directory, the ids of the three call tokens)."""
    from core.chat import chat_prompt_ids
    from tests.chat_families import FAMILIES, chat_tokenizer

    spec = {**FAMILIES["qwen2_5"], "added": ["<tool_call>", "</tool_call>", CALL]}
    tok = chat_tokenizer(tmp_path / "tokenizer", "qwen2_5", spec=spec)
    start, body, end = (tok.convert_tokens_to_ids(t) for t in ("<tool_call>", CALL, "</tool_call>"))
    header = chat_prompt_ids(tok, [{"role": "user", "content": "What is 12 + 30?"}])[-1]  # the generation prompt's
    path = scripted_model(
        tmp_path / "model", tok, "qwen2", {header: start, start: body, body: end, end: tok.eos_token_id}
    )
    return tok, path, (start, body, end)


def calculator_episodes(tmp_path, environment: str):
    """Two rows' episodes of up to three turns on the JAX sampler with the calling agent and `environment` (one
    that runs its calculator calls), each call's result checked: (the episodes, the tokenizer)."""
    from core.hf.directory import load_hf
    from rewards.pool import WorkerPool
    from rollout.environment import EnvironmentRunner
    from rollout.episodes import EpisodeLimits, run_episodes
    from rollout.jax_engine import SlotTurns
    from rollout.jax_sampler import JaxSampler
    from rollout.sampler import SamplingParams
    from rollout.tool_parsing import ToolParsers

    tok, path, calls = calling_agent(tmp_path)
    sampler = JaxSampler(load_hf(path)[0], tok.name_or_path, max_model_len=2048, seed=0)  # the tools' schema: ~700
    kwargs = {"tools": ["calculator"]} if environment == "tools" else {}
    pool = WorkerPool(1)
    try:
        env = EnvironmentRunner(environment, kwargs, pool, timeout_s=30.0)
        episodes = run_episodes(
            SlotTurns(sampler, slots=2),
            env,
            tok,
            [{"prompt": "What is 12 + 30?"}, {"prompt": "Add 12 and 30."}],
            EpisodeLimits(3, 16, 2048),
            SamplingParams(n=1, temperature=1.0, max_tokens=16, seed=5),
            ToolParsers("hermes", tok),
        )
    finally:
        pool.close()
    for e in episodes:
        assert e.error is None and e.turns == 3 and e.tool_calls == 3 and e.tool_errors == 0, e
        assert [t for t, own in zip(e.token_ids, e.sampled, strict=True) if own] == [*calls, tok.eos_token_id] * 3
        replies = tok.decode([t for t, own in zip(e.token_ids, e.sampled, strict=True) if not own])
        assert replies.count("42") >= 2, replies  # the calculator's result after the turns' calls
    return episodes, tok


def test_the_built_in_tools_environment_runs_the_calculator_on_the_jax_sampler(tmp_path):
    """`rl.agent={environment: tools, environment_kwargs: {tools: [calculator]}}` on a real sampler: a scripted
    model calls the calculator in every turn (Qwen2.5's template and Hermes calls: `<tool_call>`, the JSON, then
    `</tool_call>`); each call is parsed, run, and its result comes back as a `tool` message whose tokens sit
    between the turns, untrained; an episode runs its three turns."""
    calculator_episodes(tmp_path, "tools")


@pytest.mark.integration
@pytest.mark.serial
@pytest.mark.parametrize("family,arch", [("qwen3", "qwen3"), ("llama3_1", "llama")])
def test_every_trained_token_carries_vllms_own_log_prob(tmp_path_factory, tmp_path, family, arch):
    """A vLLM engine on Ray (float32), each turn its own request as a run sends it (`EngineTurns`), on Qwen3's
    and Llama 3.1's shipped templates (Qwen2.5's on vLLM is in tests/test_grpo_e2e.py)."""
    import shutil

    import ray

    from rollout.config import RolloutConfig
    from rollout.group import SamplerGroup
    from rollout.ray import ensure_ray
    from rollout.turns import EngineTurns
    from rollout.vllm_actor import RemoteVLLMSampler
    from tests.test_chat import make_tokenizer

    tok = make_tokenizer(tmp_path_factory, family)
    path = stopping_model(tmp_path / "model", tok, arch)
    for f in Path(tok.name_or_path).iterdir():  # the engine reads the tokenizer from the model's directory
        if f.is_file():
            shutil.copy(f, path / f.name)
    ensure_ray(num_cpus=2)
    cfg = RolloutConfig(max_model_len=512, max_num_seqs=8, kv_cache_gib=0.25, dtype="float32")
    sampler = RemoteVLLMSampler.start(str(path), cfg, seed=0, timeout_s=300)
    try:
        turns = EngineTurns(SamplerGroup([sampler]), push=lambda s: None)
        assert_trained_tokens_carry_the_samplers_log_probs(turns, tok, path, 1e-4)
    finally:
        sampler.shutdown()
        ray.shutdown()


# ------------------------------------------------------------------------------------------------- GRPO


@pytest.mark.integration
@pytest.mark.parametrize("method", ["online_dpo", "on_policy_distill"])
def test_online_dpo_and_on_policy_distillation_train_on_whole_trajectories(tmp_path, tmp_path_factory, method):
    """Online DPO (a row's best and worst episode as the pair) and on-policy distillation (the teacher scores the
    model's tokens) with `rl.agent` and the JAX sampler in one process (its slots' continuous batching, each turn
    continuing its episode's tokens): multi-turn episodes with the environment's tokens between the turns, a
    finite loss, and only the model's tokens as targets (distillation: the sampler / trainer log-prob gap over the
    targets is float32 noise, which the environment's tokens, with no sampler log-prob, would break). The tokenizer
    is a base model's (EOS `<|endoftext|>`) and the model ends its turns with `<|im_end|>`: the runs stop turns on
    the template's end of turn (`core.chat.turn_stop_ids`), or no episode would take a second turn."""
    from core.config_loader import load_config
    from core.metrics import read_metrics
    from posttrain.config import PostTrainConfig
    from posttrain.distill.onpolicy import ON_POLICY_DISTILL
    from posttrain.dpo.online import ONLINE_DPO
    from posttrain.onpolicy.run import build_sampler_run
    from tests.chat_families import FAMILIES, chat_tokenizer

    base = {**FAMILIES["qwen2_5"], "eos": "<|endoftext|>"}
    tok = chat_tokenizer(tmp_path / "tokenizer", "qwen2_5", spec=base)
    assert tok.eos_token == "<|endoftext|>"
    common = [
        f"run.run_dir={tmp_path / 'run'}",
        f"checkpoint.init_from={stopping_model(tmp_path / 'model', tok, 'qwen2', stop='<|im_end|>')}",
        f"data.tokenizer_dir={tok.name_or_path}",
        "rollout.sampler=jax",
        "rollout.max_tokens=12",
        "rollout.max_model_len=256",
        "rollout.temperature=0.7",
        "train.steps=2",
        "rl.batch.prompts_per_step=2",
        "reward.functions=[]",
        "checkpoint.export_hf=false",
    ]
    if method == "online_dpo":
        agent = f"rl.agent={{environment: '{__file__}:Scorer', max_turns: 3}}"
        cfg = load_config("recipes/configs/dpo_online_tiny.yml", [*common, agent], schema=PostTrainConfig)
        build_sampler_run(cfg, ONLINE_DPO).fit()
    else:
        teacher = stopping_model(tmp_path / "teacher", tok, "llama", stop="<|im_end|>")
        agent = f"rl.agent={{environment: '{__file__}:Chatter', max_turns: 3}}"
        on_policy = ["distill.regime=on_policy", f"distill.teacher={teacher}", "rl.batch.num_generations=2"]
        cfg = load_config("recipes/configs/grpo_tiny.yml", [*common, *on_policy, agent], schema=PostTrainConfig)
        build_sampler_run(cfg, ON_POLICY_DISTILL).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "agent/turns" in r]
    assert len(rows) == 2 and max(r["agent/turns"] for r in rows) > 1.5, rows
    assert min(r["agent/env_tokens"] for r in rows) > 0 and all(r["agent/failed"] == 0 for r in rows)
    trained = [r for r in rows if "loss" in r]
    assert trained and all(np.isfinite(r["loss"]) for r in trained), rows
    if method == "online_dpo":
        assert sum(r["pairs"] for r in rows) > 0
    else:
        assert all(np.isfinite(r["reverse_kl"]) for r in rows)
        assert all(r["mismatch/logp_gap_mean"] < 1e-4 for r in rows), [r["mismatch/logp_gap_mean"] for r in rows]


@pytest.mark.integration
def test_a_bad_agent_config_is_refused_before_anything_starts(tmp_path, tmp_path_factory):
    from core.config_loader import ConfigError, load_config
    from posttrain.config import PostTrainConfig
    from posttrain.grpo import GRPO
    from posttrain.onpolicy.run import build_sampler_run
    from tests.test_chat import make_tokenizer

    tok = make_tokenizer(tmp_path_factory, "qwen2_5")
    base = [f"run.run_dir={tmp_path}", f"data.tokenizer_dir={tok.name_or_path}", "rollout.sampler=jax"]
    cases = {
        "rl.agent={environment: no_such_env}": "rl.agent.environment='no_such_env' cannot be built",
        f"rl.agent={{environment: '{__file__}:Chatter', tool_parser: hermez}}": "unknown tool parser 'hermez'",
        "rl.agent={environment: tools}": "needs at least one tool",
    }
    for override, message in cases.items():
        cfg = load_config("recipes/configs/grpo_tiny.yml", [*base, override], schema=PostTrainConfig)
        with pytest.raises(ConfigError, match=message):
            build_sampler_run(cfg, GRPO)
    gemma = make_tokenizer(tmp_path_factory, "gemma")
    cfg = load_config(
        "recipes/configs/grpo_tiny.yml",
        [
            f"run.run_dir={tmp_path}",
            f"data.tokenizer_dir={gemma.name_or_path}",
            "rollout.sampler=jax",
            "rl.agent={environment: tools, environment_kwargs: {tools: [calculator]}}",
        ],
        schema=PostTrainConfig,
    )
    with pytest.raises(ConfigError, match="cannot continue with a tool reply"):
        build_sampler_run(cfg, GRPO)
