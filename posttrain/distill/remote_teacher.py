"""Online distillation's teacher in a Ray actor of its own, for a teacher that does not fit beside the student.

    teacher = RemoteTeacher.start(cfg, student_vocab=V, student="runs/sft/hf")    # distill.teacher_placement=actor
    ids, logp = teacher.score(packed, micro_batches=2)     # [B, C, k] each: the teacher's top-k at every target slot
    teacher.close()

The actor (`TeacherScorer`) loads `distill.teacher` onto its own devices (FSDP over every device its process sees:
`distill.teacher_gpus` GPUs under Ray, or the host's XLA devices on CPU), checks its vocabulary against the
student's, and answers each training batch with the teacher's top-`distill.top_k` ids and log-probs at T = 1 at
every target slot: the offline dump's pass (`posttrain.distill.dump.topk_pass`, the vocabulary in chunks), run live
on the batch the student is about to train on, micro-batch by micro-batch as the learner splits it. The student
then trains the offline regime's objective on them (renormalised over the top-k at any T, or with the tail bucket
at T = 1). Only [B, C, k] ids and log-probs cross between the processes; the whole vocabulary would be [tokens, V].

An actor that dies, or a call that outlasts `distill.teacher_timeout_s`, raises `TeacherUnavailable`: the run stops
with that message and the same command resumes it from its last checkpoint. One that cannot start (a bad teacher
path, a vocabulary smaller than the student's) raises it at start with the actor's own error line. Distillation's
attach starts the actor and the trainer stops it when the run ends (`core.method.Served`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from core.batch import PackedBatch
from core.errors import TemperError
from posttrain.config import PostTrainConfig


class TeacherUnavailable(TemperError, RuntimeError):
    """The teacher actor did not start, died or did not answer in time (`reason`: Ray's error, in a line)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class TeacherScorer:
    """The actor: a teacher on its own mesh and its jitted top-k pass."""

    def __init__(self, cfg_json: dict, student_vocab: int, student: str):
        import jax
        from flax import nnx

        from core.config import MeshConfig
        from core.mesh import make_mesh
        from posttrain.distill.dump import topk_pass
        from posttrain.distill.teacher import load_teacher

        cfg = PostTrainConfig.model_validate(cfg_json)
        self.mesh = make_mesh(MeshConfig(), jax.devices())
        teacher = load_teacher(cfg, self.mesh, student_vocab, student)
        self.graphdef, self.params = nnx.split(teacher)
        self.run = topk_pass(self.graphdef, cfg.distill.top_k, 1.0, student_vocab)
        self.devices = jax.device_count()

    def describe(self) -> str:
        import jax

        return f"{jax.devices()[0].platform} x{self.devices} (pid {os.getpid()})"

    def score(self, packed: PackedBatch, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
        """([B, C, k] int32 ids, [B, C, k] float32 log-probs) of the teacher's top-k at every target slot of
        `packed` (a host batch of `micro_batches` micro-batches, as the learner will split it)."""
        import jax

        from core.train import place_batch, split_micro_batches

        placed = place_batch(split_micro_batches(packed, micro_batches, self.mesh), self.mesh)
        ids, logp = [], []
        with jax.set_mesh(self.mesh):
            for i in range(micro_batches):
                got = self.run(self.params, jax.tree.map(lambda x, i=i: x[i], placed))
                ids.append(got[0])
                logp.append(got[1])
        ids_np, logp_np = jax.device_get((ids, logp))
        return np.concatenate(ids_np).astype(np.int32), np.concatenate(logp_np).astype(np.float32)


class RemoteTeacher:
    """The student's handle on the teacher actor (typed calls, each with a timeout)."""

    def __init__(self, actor: Any, timeout_s: float):
        self.actor, self.timeout_s = actor, timeout_s
        self.where = ""  # the actor's devices and process, once started

    @classmethod
    def start(cls, cfg: PostTrainConfig, student_vocab: int, student: str) -> RemoteTeacher:
        """The actor on `distill.teacher_gpus` GPUs (0 on CPU: the host's XLA devices), started and loaded."""
        import ray

        from rollout.ray import ensure_ray, jax_actor_env

        ensure_ray()
        gpus = cfg.distill.teacher_gpus
        env = jax_actor_env(gpus=gpus > 0)
        actor = (
            ray.remote(TeacherScorer)
            .options(num_cpus=1, num_gpus=gpus, max_concurrency=1, runtime_env={"env_vars": env})
            .remote(cfg.model_dump(mode="json"), student_vocab, student)
        )
        handle = cls(actor, cfg.distill.teacher_timeout_s)
        try:  # start-up errors (a bad path, a vocabulary the student's tokens overrun) show here
            handle.where = handle._call(TeacherScorer.describe)
        except TeacherUnavailable as err:
            handle.close()
            raise TeacherUnavailable(f"the teacher actor could not start: {err.reason}") from None
        return handle

    def _call(self, method: Callable, *args: Any) -> Any:
        from rollout.ray import call_actor

        return call_actor(self.actor, method, args, self.timeout_s, _unavailable)

    def score(self, packed: PackedBatch, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
        return self._call(TeacherScorer.score, packed, micro_batches)

    def close(self) -> None:
        """Stop the actor (its devices go back to the cluster); a dead one is left as it is."""
        import ray

        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(self.actor)


def _unavailable(name: str, err: Exception) -> TeacherUnavailable:
    """The actor is gone, or did not answer in time."""
    reason = f"{type(err).__name__}: {_reason(err)}"
    return TeacherUnavailable(
        f"the teacher actor is unavailable during {name}() ({reason}); run the same command again to resume from "
        f"the last checkpoint",
        reason=reason,
    )


def _reason(err: Exception) -> str:
    """The line that says why: an actor whose start-up raised reports that exception's last line in its text."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    raised = [line for line in lines if "Error: " in line and not line.startswith("ray.exceptions")]
    return raised[-1] if raised else (lines[0] if lines else "")
