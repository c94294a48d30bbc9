"""PPO's critic: a decoder with a scalar value head, where it comes from, its value pass and its export.

    critic = critic_for(cfg, policy, mesh)              # a copy of the policy, or `ppo.critic_init_from`'s model
    values = grouped_logprobs(ValuePass(), critic, packed, mesh)   # [B, C] V(s_t) of every target's state
    export_critic(critic, run_dir / "hf", tokenizer_dir)           # run_dir/hf/critic, a token-classification model

The critic starts as a copy of the policy's starting weights (LoRA adapters included) or as another causal LM
(`ppo.critic_init_from`: an HF directory, a Hub id or a Temper run, with its own shape, its adapters merged), with a
zero-initialised head, so every value starts at 0. `check_critic_source` checks that key at start; the vocabulary
(it must hold the policy's token ids) is checked when the model loads. The export writes the backbone as its family
does and the head as `score`, which `transformers.AutoModelForTokenClassification` reads (`posttrain.ppo` is the
method that trains it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from core.config_loader import ConfigError
from core.distributed import CompiledTogether
from core.models import Decoder
from core.targets import target_states
from posttrain.config import PostTrainConfig
from posttrain.frozen import LogprobPass, copied


def scalar_head(hidden_size: int, mesh: Mesh, seed: int) -> nnx.Linear:
    """A zero-initialised float32 linear map from the hidden state to one number, replicated on `mesh`."""
    head = nnx.Linear(hidden_size, 1, kernel_init=nnx.initializers.zeros, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    nnx.update(head, jax.device_put(nnx.state(head), NamedSharding(mesh, PartitionSpec())))
    return head


class Critic(nnx.Module):
    """A decoder with a scalar head: V(s_t) from the final hidden state that predicts token t."""

    def __init__(self, backbone: Decoder, mesh: Mesh, seed: int):
        self.backbone = backbone
        self.value_head = scalar_head(backbone.cfg.hidden_size, mesh, seed)

    def values(self, packed: Any, rng: jax.Array | None = None) -> jax.Array:
        """[B, C] the value of each target's state (0 where there is no target)."""
        states = target_states(self.backbone, packed, rng=rng)
        return states.to_slots(self.value_head(states.hidden.astype(jnp.float32))[:, 0])


def _values(graphdef, state, batch) -> jax.Array:
    return nnx.merge(graphdef, state).values(batch)  # the critic routes as its own routers do


class ValuePass(LogprobPass):
    """The critic's values of a packed batch's targets, one packing group at a time (`grouped_logprobs`)."""

    def __init__(self):
        super().__init__(1.0)
        self._jitted = CompiledTogether(jax.jit(_values, static_argnums=(0,)), "the critic's value pass")

    def __call__(self, critic, batch):
        graphdef, state = nnx.split(critic)
        return self._jitted(graphdef, state, batch)


def check_critic_source(path: str | None) -> None:
    """`ppo.critic_init_from` at start, before anything starts: a local path that exists (an HF directory, a
    Temper run or checkpoint) or a Hub id; an HF directory's config must be a dense model's."""
    if path is None:
        return
    from core.hf.config import model_section_from_hf
    from core.hf.hub import looks_like_hub_id

    local = Path(path)
    if not local.exists():
        if looks_like_hub_id(path):
            return  # read through the Hub cache when the trainer starts
        raise ConfigError(f"ppo.critic_init_from={path!r}: no such file or directory, and not a Hub model id")
    config = local / "config.json"
    if config.exists() and model_section_from_hf(json.loads(config.read_text()), source=str(config)).get("moe"):
        raise ConfigError(f"ppo.critic_init_from={path!r} is a mixture of experts: PPO's critic is dense")


def critic_for(cfg: PostTrainConfig, model: Decoder, mesh: Mesh) -> Critic:
    """The critic of the policy `model`: a copy of its starting weights, or `ppo.critic_init_from`'s model (its own
    shape; its vocabulary must hold the policy's token ids), with a zero value head."""
    path = cfg.ppo.critic_init_from
    if path is None:
        return Critic(copied(model, mesh), mesh, cfg.run.seed)
    from core.checkpoint_models import load_model_from
    from core.models.adapters import merged_model

    try:
        with jax.set_mesh(mesh):  # a run that trained LoRA adapters: its model with them merged, trained whole
            backbone = merged_model(load_model_from(path, mesh, dtype=model.cfg.param_dtype))
    except (OSError, ValueError) as err:
        raise ConfigError(f"ppo.critic_init_from={path!r}: {err}") from None
    if backbone.cfg.vocab_size < model.cfg.vocab_size:
        raise ConfigError(
            f"ppo.critic_init_from={path!r} has a vocabulary of {backbone.cfg.vocab_size} tokens, fewer than the "
            f"policy's {model.cfg.vocab_size}: the critic reads the policy's token ids"
        )
    if backbone.cfg.moe is not None:
        raise ConfigError(f"ppo.critic_init_from={path!r} is a mixture of experts: PPO's critic is dense")
    return Critic(backbone, mesh, cfg.run.seed)


def export_critic(critic: Critic, hf_dir: Path, tokenizer_dir: str | None) -> None:
    """The critic, to `hf_dir/critic`: its backbone as its family writes it, with a one-label token-classification
    head (`score`), as `transformers` reads a value model."""
    export_scored(critic.backbone, critic.value_head, hf_dir / "critic", tokenizer_dir, "ForTokenClassification")


def export_scored(backbone: Decoder, head: nnx.Linear, out: Path, tokenizer_dir: str | None, kind: str) -> None:
    """`backbone` as its family writes it, to `out`, with `head` as a one-label classification head (`score`):
    `kind` names the `transformers` class (`ForTokenClassification`: a value per token; `ForSequenceClassification`:
    one per sequence, at its last token)."""
    from safetensors.numpy import load_file, save_file

    from core.distributed import is_primary
    from core.hf.directory import save_hf

    out = Path(save_hf(backbone, backbone.cfg, out, tokenizer_dir=tokenizer_dir))
    if not is_primary():  # the others took part in the backbone's gathers
        return
    state = nnx.state(head)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [a.replace("ForCausalLM", kind) for a in config["architectures"]]
    config["num_labels"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    dtype = jnp.dtype(backbone.cfg.param_dtype)
    score = {
        "score.weight": np.asarray(state["kernel"][...]).T.astype(dtype),
        "score.bias": np.asarray(state["bias"][...]).astype(dtype),
    }
    weights, index = out / "model.safetensors", out / "model.safetensors.index.json"
    if weights.exists():  # one file: the head joins it
        save_file({**load_file(str(weights)), **score}, str(weights), metadata={"format": "pt"})
    else:  # sharded: the head is a shard of its own, named in the index
        save_file(score, str(out / "score.safetensors"), metadata={"format": "pt"})
        table = json.loads(index.read_text())
        table["weight_map"].update({name: "score.safetensors" for name in score})
        table["metadata"]["total_size"] += sum(int(v.nbytes) for v in score.values())
        index.write_text(json.dumps(table, indent=2))
