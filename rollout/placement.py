"""Where a run's actors go: one Ray placement group for the trainer's processes, one for an on-policy run's samplers.

    placement = reserve(cfg)                   # both groups, ready (fails fast, with the numbers, if they cannot fit)
    trainer process i: in_bundle(placement.trainer, i)      (`placement.trainer_processes` bundles)
    sampler = start_vllm_sampler(cfg, hf_dir, 0, placement)  # bundle 0 of placement.samplers
    pg = reserve_trainer(cfg.placement)        # an offline run: the trainer's group alone

Each group has its own Ray strategy (`placement.trainer_strategy`, `placement.sampler_strategy`): the trainer's
processes exchange gradients by collectives, so PACK (as few nodes as fit) suits them; the samplers only receive
weights and send completions, so SPREAD over nodes costs them little. STRICT_PACK / STRICT_SPREAD fail rather than
bend. The groups are reserved up front, so a run that cannot fit fails at start, not halfway through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.config import LoraConfig, PlacementConfig
from rollout.config import SamplingJob
from rollout.vllm_actor import RemoteVLLMSampler


@dataclass
class Placement:
    """The run's two placement groups (Ray `PlacementGroup`s)."""

    trainer: Any  # one bundle per trainer process
    samplers: Any  # one bundle per vLLM sampler

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.samplers)
        remove_placement_group(self.trainer)


def placement_bundles(cfg: SamplingJob, resources: dict[str, float]) -> tuple[list[dict], list[dict]]:
    """(one bundle per trainer process, one per vLLM sampler: `rollout.rollout_data_parallelism`).

    With GPUs the split follows `mesh.trainer_devices_fraction` / `sampler_devices_fraction`, the trainer's GPUs
    shared evenly by its processes; on CPU each trainer process gets one CPU and the samplers share the rest, or, on
    a cluster without a CPU to spare, all share the CPUs evenly (vLLM's CPU threads are bound separately).
    """
    k, n = cfg.rollout.rollout_data_parallelism, cfg.placement.trainer_processes
    gpus = int(resources.get("GPU", 0))
    if gpus:
        trainer = max(n, round(cfg.mesh.trainer_devices_fraction * gpus))
        per_sampler = (cfg.mesh.sampler_devices_fraction * gpus or gpus - trainer) / k
        if per_sampler < 1 or trainer % n or trainer + k * int(per_sampler) > gpus:
            raise ValueError(
                f"cannot place a trainer on {trainer} GPU(s) in {n} process(es) and {k} sampler(s) on {gpus} GPUs "
                f"(mesh.trainer_devices_fraction={cfg.mesh.trainer_devices_fraction}, "
                f"mesh.sampler_devices_fraction={cfg.mesh.sampler_devices_fraction}, "
                f"placement.trainer_processes={n})"
            )
        trainer_bundle = {"CPU": 1.0, "GPU": float(trainer // n)}
        return [trainer_bundle] * n, [{"CPU": 1.0, "GPU": float(int(per_sampler))}] * k
    cpus = resources.get("CPU", 1)
    # A trainer process takes a CPU when one is left for the samplers; on a smaller cluster all share it evenly.
    per_process = 1.0 if cpus >= n + 1 else math.floor(100 * cpus / (n + k)) / 100
    share = max(0.01, min(1.0, math.floor(100 * (cpus - n * per_process) / k) / 100))
    return [{"CPU": per_process}] * n, [{"CPU": share}] * k


def reserve(cfg: SamplingJob, timeout_s: float = 120.0) -> Placement:
    """The run's placement groups, ready (raises with the numbers if the cluster cannot hold them)."""
    import ray

    trainer, samplers = placement_bundles(cfg, ray.cluster_resources())
    p = cfg.placement
    groups = reserve_groups(
        [("trainer", trainer, p.trainer_strategy), ("samplers", samplers, p.sampler_strategy)], timeout_s
    )
    return Placement(trainer=groups[0], samplers=groups[1])


def reserve_trainer(placement: PlacementConfig, timeout_s: float = 120.0) -> Any:
    """The placement group of an offline run's trainer processes (`placement.trainer_processes` bundles, all the
    cluster's GPUs shared evenly, one CPU each), ready."""
    import ray

    n, gpus = placement.trainer_processes, int(ray.cluster_resources().get("GPU", 0))
    if gpus and gpus % n:
        raise ValueError(f"{gpus} GPUs do not split evenly over placement.trainer_processes={n}")
    bundle = {"CPU": 1.0, "GPU": float(gpus // n)} if gpus else {"CPU": 1.0}
    return reserve_groups([("trainer", [bundle] * n, placement.trainer_strategy)], timeout_s)[0]


def reserve_groups(groups: list[tuple[str, list[dict], str]], timeout_s: float) -> list[Any]:
    """A ready Ray placement group for each (what, bundles, strategy); none is left behind when one cannot be
    reserved within `timeout_s` (the error says which, with the cluster's resources)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    made = [placement_group(bundles, strategy=strategy) for _, bundles, strategy in groups]
    for (what, bundles, strategy), pg in zip(groups, made, strict=True):
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            for other in made:
                remove_placement_group(other)
            raise RuntimeError(
                f"Ray could not reserve the {what}' bundles {bundles} ({strategy}) within {timeout_s:.0f}s; "
                f"cluster resources: {ray.cluster_resources()}, nodes: {_nodes()}"
            ) from e
    return made


def _nodes() -> list[dict]:
    import ray

    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def in_bundle(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def start_vllm_sampler(
    cfg: SamplingJob, hf_dir: str, index: int, placement: Placement | None = None, adapter: LoraConfig | None = None
):
    """Sampler `index` (seeded `run.seed + index`) in its bundle of `placement.samplers` (None: anywhere); with
    `adapter`, serving `hf_dir` as the base of the policy's LoRA adapters."""
    pg = placement.samplers if placement is not None else None
    bundle = pg.bundle_specs[index] if pg is not None else {"CPU": 0}  # what `reserve` reserved
    return RemoteVLLMSampler.start(
        hf_dir,
        cfg.rollout,
        seed=cfg.run.seed + index,
        num_cpus=bundle["CPU"],
        timeout_s=cfg.rollout.sampler_timeout_s,
        scheduling_strategy=in_bundle(pg, index) if pg is not None else None,
        adapter=adapter,
    )
