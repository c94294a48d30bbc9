"""Where an RL run's actors go: one Ray placement group with a bundle for the trainer and one per vLLM sampler.

    pg = reserve(cfg)                          # bundle 0: the trainer; 1..k: the samplers (fails fast if it cannot fit)
    sampler = start_vllm_sampler(cfg, hf_dir, 0, pg)

The group is reserved up front, so a run that cannot fit fails at start with
the numbers, not halfway through.
"""

from __future__ import annotations

from rollout.config import SamplingJob
from rollout.vllm_actor import RemoteVLLMSampler


def placement_bundles(cfg: SamplingJob, resources: dict[str, float]) -> list[dict[str, float]]:
    """Bundle 0: the trainer; then one per vLLM sampler (`rollout.rollout_data_parallelism`).

    With GPUs the split follows `mesh.trainer_devices_fraction` /
    `sampler_devices_fraction`; on CPU the trainer gets one CPU and the
    samplers share the rest (vLLM's CPU threads are bound separately).
    """
    k = cfg.rollout.rollout_data_parallelism
    gpus = int(resources.get("GPU", 0))
    if gpus:
        trainer = max(1, round(cfg.mesh.trainer_devices_fraction * gpus))
        per_sampler = (cfg.mesh.sampler_devices_fraction * gpus or gpus - trainer) / k
        if per_sampler < 1 or trainer + k * int(per_sampler) > gpus:
            raise ValueError(
                f"cannot place a trainer on {trainer} GPU(s) and {k} sampler(s) on {gpus} GPUs "
                f"(mesh.trainer_devices_fraction={cfg.mesh.trainer_devices_fraction}, "
                f"mesh.sampler_devices_fraction={cfg.mesh.sampler_devices_fraction})"
            )
        return [{"CPU": 1.0, "GPU": float(trainer)}] + [{"CPU": 1.0, "GPU": float(int(per_sampler))}] * k
    cpus = resources.get("CPU", 1)
    share = max(0.01, min(1.0, (cpus - 1) / k))
    return [{"CPU": 1.0}] + [{"CPU": round(share, 2)}] * k


def reserve(cfg: SamplingJob, timeout_s: float = 120.0):
    """A ready placement group for the run (raises with the numbers if the cluster cannot hold it)."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = placement_bundles(cfg, ray.cluster_resources())
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RuntimeError(
            f"Ray could not reserve {bundles} within {timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
        ) from e
    return pg


def in_bundle(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def start_vllm_sampler(cfg: SamplingJob, hf_dir: str, index: int, pg=None) -> RemoteVLLMSampler:
    """Sampler `index` (seeded `run.seed + index`) in its bundle of `pg` (None: anywhere)."""
    bundle = pg.bundle_specs[1 + index] if pg is not None else {"CPU": 0}  # what `reserve` reserved
    return RemoteVLLMSampler.start(
        hf_dir,
        cfg.rollout,
        seed=cfg.run.seed + index,
        num_cpus=bundle["CPU"],
        timeout_s=cfg.rollout.sampler_timeout_s,
        scheduling_strategy=in_bundle(pg, 1 + index) if pg is not None else None,
    )
