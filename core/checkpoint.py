"""Orbax checkpoints: params, optimizer state, step, RNG, data-iterator state and config in one.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=2, async_save=True)
    ckpt.save(step, state, data_iterator, config)          # async; atomic on commit
    state = ckpt.restore(ckpt.latest_step(), abstract_state, data_iterator, config)

Orbax writes each step to a temporary directory and renames it when complete,
so a process killed mid-save leaves the previous checkpoints intact (its
temporary directory is removed at the next start). A committed checkpoint that
cannot be read back (a truncated or deleted file) is moved aside as
`corrupt-<step>` by `restore_latest`, with a warning, and the previous one is
restored instead. In a JAX process group (`core.distributed`) every process calls
the same methods: each writes and reads its own shards, and Orbax commits a
step once all have written. Restoring takes a target tree (shapes, dtypes and
shardings), so a checkpoint written on one mesh restores onto another. Before
restoring, the saved model config and tensor shapes are compared with the
target and every difference is reported. Reading a checkpoint never imports
user code: the saved config is read as data, and only its model section is
validated.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from core.config import Config
from core.distributed import any_process, barrier, is_primary
from core.errors import CheckpointMismatch, TemperError
from core.train import TrainState

log = logging.getLogger("temper.checkpoint")


class NoUsableCheckpoint(TemperError):
    """Every checkpoint in the directory failed to restore (each one was moved aside, nothing was lost)."""


def pure_state(params: nnx.State) -> dict:
    return nnx.to_pure_dict(params)


def saved_config(step_dir: str | Path) -> dict:
    """The config a checkpoint was written with, as plain data (never validated here: no plugin is imported).

    Read from the JSON item directly, so that no other item is opened (a partial Orbax restore logs a
    warning for every item it skips)."""
    path = Path(step_dir) / "config" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointMismatch(f"checkpoint {step_dir}: its config ({path}) cannot be read: {err}") from None


ITEMS = ("params", "opt_state", "meta", "config", "data")  # what a checkpoint step holds (`Checkpointer.save`)


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # what a process killed mid-save left behind
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # ------------------------------------------------------------ saving

    def save(
        self,
        state: TrainState,
        data_iterator: Any | None,
        config: Config,
        extra: dict | None = None,
        step: int | None = None,
    ) -> int:
        """Save as checkpoint `step` (default: `state.step`; async when enabled). Returns the step."""
        step = int(state.step) if step is None else step
        meta = {"step": int(state.step), "rng": np.asarray(jax.random.key_data(state.rng)).tolist(), **(extra or {})}
        items = dict(  # ITEMS
            params=ocp.args.StandardSave(pure_state(state.params)),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave(meta),
            config=ocp.args.JsonSave(config.model_dump(mode="json")),
        )
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        return step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ------------------------------------------------------------ restoring

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore_latest(
        self, target: TrainState, data_iterator: Any | None, config: Config
    ) -> tuple[TrainState, dict, int] | None:
        """(state, meta, step) of the newest checkpoint that restores whole, or None when there is none.

        A checkpoint that fails to read back (truncated or missing files) is moved aside as
        `corrupt-<step>` with a warning and the previous one is tried; a checkpoint of another model
        (`CheckpointMismatch`) is the user's to resolve and raises at once.
        """
        failures = []
        for step in sorted(self.all_steps(), reverse=True):
            error: Exception | None = None
            try:
                state, meta = self.restore(step, target, data_iterator, config)
            except CheckpointMismatch:
                raise
            except Exception as err:
                error = err
            # In a process group one process may fail to read its shards while the others succeed: all agree,
            # so that every process moves on to the same checkpoint (a collective).
            if any_process(error is not None):
                moved = self._move_aside(step)
                err_text = str(error).splitlines()[0] if error is not None and str(error) else ""
                reason = f"{type(error).__name__}: {err_text}" if error is not None else "another process failed"
                failures.append(f"{step} ({reason})")
                message = (
                    f"checkpoint {self.directory / str(step)} cannot be restored ({reason}); "
                    f"moved to {moved}, trying the previous one"
                )
                log.warning(message)
                print(f"warning: {message}", flush=True)
                continue
            return state, meta, step
        if failures:
            raise NoUsableCheckpoint(
                f"no checkpoint in {self.directory} could be restored: {'; '.join(failures)}. "
                f"They were moved aside (corrupt-*); start a fresh run or restore one by hand."
            )
        return None

    def _move_aside(self, step: int) -> Path:
        """Rename a step's directory so that Orbax no longer lists it (and a later save may reuse the step). In a
        process group the first process moves it, and the others wait for that before they look again."""
        src = self.directory / str(step)
        dst = self.directory / f"corrupt-{step}-{int(time.time())}"
        if is_primary():
            shutil.move(str(src), str(dst))
        barrier(f"checkpoint {step} moved aside")
        self.manager.reload()
        return dst

    def restore(
        self, step: int, target: TrainState, data_iterator: Any | None, config: Config
    ) -> tuple[TrainState, dict]:
        """Restore into the shardings of `target` (abstract or concrete); the data iterator in place."""
        self.check_compatible(step, target, config)
        items = dict(
            params=ocp.args.StandardRestore(abstract_tree(pure_state(target.params))),
            opt_state=ocp.args.StandardRestore(abstract_tree(target.opt_state)),
            meta=ocp.args.JsonRestore(),
        )
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except ValueError as err:
            if "tree structures do not match" not in str(err):
                raise
            # The parameters were compared above: what differs is the optimizer state's shape. Not a corrupt
            # checkpoint (it must not be moved aside): the user's to resolve.
            raise CheckpointMismatch(
                f"checkpoint {self.directory / str(step)}: its optimizer state has another structure than this run's "
                f"(another optim.name, or a method whose optimizer has changed since it was written); resume with "
                f"the optimizer it was written with, or start a new run from its model with "
                f"checkpoint.init_from={self.directory / str(step)}"
            ) from None
        params = nnx.State(target.params)
        nnx.replace_by_pure_dict(params, out["params"])
        meta = dict(out["meta"])
        rng = jax.random.wrap_key_data(jax.numpy.asarray(meta["rng"], jax.numpy.uint32))
        step_count = jax.numpy.asarray(meta["step"], jax.numpy.int32)
        return TrainState(params, out["opt_state"], step_count, rng), meta

    def check_compatible(self, step: int, target: TrainState, config: Config) -> None:
        """Raise `CheckpointMismatch` naming every model-config key and tensor that differs."""
        where = self.directory / str(step)
        saved_cfg = saved_config(where)
        ours = config.model.model_dump(mode="json")
        theirs = saved_cfg.get("model", {})
        diffs = [
            f"model.{k}: checkpoint {theirs.get(k)!r}, this run {ours.get(k)!r}"
            for k in sorted(set(ours) | set(theirs))
            if k in _SHAPE_KEYS and theirs.get(k) != ours.get(k)
        ]
        meta = self.manager.item_metadata(step)
        saved = meta["params"] if meta is not None and "params" in meta else None
        unknown = sorted(d.name for d in where.iterdir() if d.is_dir() and d.name not in ITEMS)
        if unknown:
            # e.g. Temper before the one-module-tree contract saved a second trained module as an item of its
            # own; such state does not map onto today's one tree.
            raise CheckpointMismatch(
                f"checkpoint {where} was written by an earlier Temper (it holds "
                + ", ".join(f"`{name}`" for name in unknown)
                + f" item(s) this version does not write) and cannot be resumed; start a new run from its model "
                f"with checkpoint.init_from={where}"
            )
        if saved is not None:  # the trainable state: every tensor with its shape (a LoRA run's: its adapters)
            diffs += _tensor_diffs(_flat_shapes(saved), _flat_shapes(pure_state(target.params)), "")
        if diffs:
            raise CheckpointMismatch(
                f"checkpoint {where} was written for a different model:\n  " + "\n  ".join(diffs[:40])
            )


def _tensor_diffs(saved: dict, ours: dict, what: str) -> list[str]:
    return [
        f"{what}tensor {path}: checkpoint {saved.get(path)}, this run {ours.get(path)}"
        for path in sorted(set(saved) | set(ours))
        if saved.get(path) != ours.get(path)
    ]


_SHAPE_KEYS = {
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
    "scan_layers",
    "lora",
}


def abstract_tree(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def dotted_path(path) -> str:
    """A pytree key path as `layers.attn.q_proj.kernel` (dict keys, sequence indices and attributes alike)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return ".".join(parts)


def _flat_shapes(tree: Any) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {dotted_path(path): tuple(np.shape(v)) for path, v in flat}
