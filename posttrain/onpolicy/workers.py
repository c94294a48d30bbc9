"""The on-policy run's workers: the samplers it starts against its trainer, and their release at the end.

- vLLM: `rollout.rollout_data_parallelism` engines as Ray actors in the run's placement group, started from the
  trainer's weights written as a Hugging Face directory, and restarted by the sampler group when one fails; with
  LoRA and `rollout.lora_sync=adapters` each engine serves the adapters it is sent.
- JAX: one sampler in this process, on the devices `mesh.sampler_devices_fraction` leaves it (or the trainer's),
  holding the base once when the policy has LoRA adapters (later syncs move the adapters alone).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from core.config import ModelConfig
from posttrain.config import PostTrainConfig
from posttrain.trainer import TrainerHandle
from rollout.engine_programs import EnginePrograms
from rollout.group import SamplerGroup
from rollout.jax_engine import SlotTurns
from rollout.jax_sampler import JaxSampler
from rollout.placement import Placement, start_vllm_sampler
from rollout.sampler import Sampler
from rollout.turns import EngineTurns, Turns
from rollout.weight_sync import SyncStats


def start_samplers(
    cfg: PostTrainConfig,
    trainer: TrainerHandle,
    placement: Placement | None,
    init_hf: Path,
    tokenizer_dir: str,
    push: Callable[[Sampler], SyncStats],
) -> tuple[SamplerGroup, Path | None]:
    """The run's samplers, each sent the trainer's current weights by `push`, and the Hugging Face directory vLLM
    engines started from (the trainer's weights written at `init_hf`; None with the JAX sampler)."""
    start_dir: str | None = None
    if cfg.rollout.sampler == "jax":
        group = SamplerGroup([jax_sampler(cfg, trainer, tokenizer_dir)])
    else:
        start_dir = trainer.sampler_start(str(init_hf), tokenizer_dir)
        lora = ModelConfig.model_validate(trainer.model_config()).lora
        adapter = lora if lora is not None and cfg.rollout.lora_sync == "adapters" else None

        def start(i: int) -> Sampler:
            assert start_dir is not None
            return start_vllm_sampler(cfg, start_dir, i, placement, adapter)

        group = SamplerGroup([start(i) for i in range(cfg.rollout.rollout_data_parallelism)], restart=start)
    group.sync(push)
    return group, None if start_dir is None else Path(start_dir)


def jax_sampler(cfg: PostTrainConfig, trainer: TrainerHandle, tokenizer_dir: str) -> Sampler:
    """A JAX sampler beside the trainer in this process (single controller), on its own sub-mesh or the trainer's."""
    import jax

    from core.config import MeshConfig
    from core.mesh import make_mesh, split_devices
    from core.models import create_model
    from rollout.jax_sampler import JaxSampler

    local = trainer.local()  # single controller: the trainer lives in this process
    _, sampler_devices = split_devices(
        jax.devices(), cfg.mesh.trainer_devices_fraction, cfg.mesh.sampler_devices_fraction
    )
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=-1), sampler_devices) if sampler_devices else local.mesh
    with jax.set_mesh(mesh):
        model = create_model(local.cfg.model, mesh, seed=0)  # placeholder weights, replaced by the first sync
    sampler = JaxSampler(model, tokenizer_dir, mesh=mesh, max_model_len=cfg.rollout.max_model_len, seed=cfg.run.seed)
    if local.cfg.model.lora is not None:  # the base, once: later syncs move the adapters alone
        from flax import nnx

        from rollout.weight_sync import reshard_to_jax_sampler

        reshard_to_jax_sampler(nnx.state(local.learner.model()), sampler, cfg.rollout.reshard_chunk_bytes)
    return sampler


def release(steps: Sequence[tuple[str, Callable[[], object]]], timeout_s: float) -> None:
    """Run each (what, action) in turn, best effort: a failure is said, not raised over the error that stopped the
    run, and the whole gets `timeout_s`, so a Ray cluster that went away cannot keep the run from ending."""

    def run_all():
        for what, action in steps:
            try:
                action()
            except Exception as e:
                print(f"closing {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)

    worker = threading.Thread(target=run_all, name="temper-close", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        print(
            f"closing: Ray did not answer within {timeout_s:.0f} s (is the cluster gone?); leaving the rest "
            f"of the clean-up to Ray",
            flush=True,
        )


def episode_turns(
    cfg: PostTrainConfig,
    samplers: SamplerGroup,
    push: Callable[[Sampler], SyncStats],
    episodes: int,
    cancelled: threading.Event | None,
    programs: EnginePrograms,
) -> Turns:
    """How `episodes` episodes' turns reach the samplers: each its own request on the vLLM engines (`cancelled`: set
    when the run stops), or slots of the JAX sampler's continuous batching (as many as episodes run at once, to a
    power of two; `programs`: its compiled programs, shared by every step)."""
    if cfg.rollout.sampler == "vllm":
        return EngineTurns(samplers, push, cancelled=cancelled)
    agent = cfg.rl.agent
    assert agent is not None  # turns are an agent's
    running = min(episodes, agent.max_concurrency or episodes, cfg.rollout.max_num_seqs)
    (sampler,) = samplers.samplers  # single-controller: the one JAX sampler
    assert isinstance(sampler, JaxSampler)
    return SlotTurns(sampler, slots=1 << max(0, running - 1).bit_length(), programs=programs)


def workers_to_release(
    samplers: SamplerGroup | None, trainer: TrainerHandle, placement: Placement | None
) -> list[tuple[str, Callable[[], object]]]:
    """What a run releases at its end, in order (`release`): each sampler (none before they started), the trainer,
    then on Ray the placement groups and the trainer's actors."""
    started = samplers.samplers if samplers is not None else []
    steps: list[tuple[str, Callable[[], object]]] = [(f"sampler {i}", s.stop) for i, s in enumerate(started)]
    steps.append(("trainer", trainer.close))
    if placement is not None:
        steps.append(("placement groups", placement.remove))
        steps.append(("trainer actors", trainer.kill))
    return steps
