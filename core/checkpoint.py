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
from typing import Any, TypeVar

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from core.config import Config, ModelConfig
from core.distributed import any_process, barrier, is_primary
from core.errors import CheckpointMismatch, MissingPath, TemperError
from core.train import TrainState

log = logging.getLogger("temper.checkpoint")


class NoUsableCheckpoint(TemperError):
    """Every checkpoint in the directory failed to restore (each one was moved aside, nothing was lost)."""


def _pure(params: nnx.State) -> dict:
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
            params=ocp.args.StandardSave(_pure(state.params)),
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
            params=ocp.args.StandardRestore(_abstract(_pure(target.params))),
            opt_state=ocp.args.StandardRestore(_abstract(target.opt_state)),
            meta=ocp.args.JsonRestore(),
        )
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
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
            diffs += _tensor_diffs(_flat_shapes(saved), _flat_shapes(_pure(target.params)), "")
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


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _dotted(path) -> str:
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
    return {_dotted(path): tuple(np.shape(v)) for path, v in flat}


# ----------------------------------------------------------- params only


def save_params(path: str | Path, params: nnx.State) -> Path:
    """Write parameters alone (e.g. for evaluation or as an SFT starting point)."""
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _pure(params), force=True)
    return path


def load_params(path: str | Path, target: nnx.State) -> nnx.State:
    """Read parameters written by `save_params` into the shardings of `target`."""
    path = Path(path).absolute()
    if not path.exists():
        raise MissingPath(f"no parameter checkpoint at {path}")
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, _abstract(_pure(target)))
    params = nnx.State(target)
    nnx.replace_by_pure_dict(params, restored)
    return params


def load_checkpoint_model(path: str | Path, mesh=None, step: int | None = None) -> tuple[Any, ModelConfig, dict]:
    """(model, its ModelConfig, the saved config as data) from a Temper run directory or its `checkpoints/`
    folder: parameters only, `step` defaulting to the latest.

    The trained model is read where the run's module tree held it (`TRAINED_MODEL` in the checkpoint's meta: the
    tree itself, or its `.model`); a LoRA run's checkpoint holds its adapters, and its base is read from the
    run's own `checkpoint.init_from` (`initial_model`'s rules). Only the saved config's model and checkpoint
    sections are read (the model section validated by `ModelConfig`), so nothing the run directory names
    (reward plugins) is imported, and a config written by another Temper version still loads.
    """
    from core.mesh import single_device_mesh

    mesh = mesh or single_device_mesh()
    path = Path(path).absolute()
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step() if step is None else step
    if step is None:
        raise MissingPath(f"no checkpoint found in {directory}")
    manager.close()
    step_dir = directory / str(step)
    saved = saved_config(step_dir)
    model_cfg = ModelConfig.model_validate(saved.get("model", {}))
    prefix = list(_saved_meta(step_dir).get(TRAINED_MODEL, []))
    if model_cfg.lora is None:
        from core.models import abstract_sharded_state

        graphdef, params = abstract_sharded_state(model_cfg, mesh)
        nnx.replace_by_pure_dict(params, _restore_subtree(step_dir / "params", prefix, _pure(params), mesh))
        return nnx.merge(graphdef, params), model_cfg, saved
    base_path = (saved.get("checkpoint") or {}).get("init_from")
    if base_path is None:
        raise CheckpointMismatch(
            f"checkpoint {step_dir} holds LoRA adapters of a randomly initialised base (checkpoint.init_from was "
            f"not set): there is no base to read them onto"
        )
    from core.peft import model_with_adapters

    model = model_with_adapters(base_path, model_cfg.lora, mesh, seed=0, dtype=model_cfg.param_dtype)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)  # type: ignore[misc]
    meta = _saved_meta(step_dir)
    check_frozen(meta.get(FROZEN), frozen_fingerprint(rest), str(step_dir), "".join(f"{k}." for k in prefix))
    nnx.replace_by_pure_dict(adapters, _restore_subtree(step_dir / "params", prefix, _pure(adapters), mesh))
    return nnx.merge(graphdef, adapters, rest), model.cfg, saved


TRAINED_MODEL = "trained_model"  # meta key: where the trained model sits in the checkpoint's trainable tree
FROZEN = "frozen_fingerprint"  # meta key: what the frozen part of the module tree was (`frozen_fingerprint`)


def frozen_fingerprint(state: Any) -> dict[str, list[float]]:
    """{dotted path: [sum, sum of squares, sum of absolute values]} of every array of a frozen state (the module
    tree's non-trainable part), in float32 over the whole array whatever its sharding (a collective in a process
    group): what a checkpoint records of the weights it does not hold, so that a resume or a later load on other
    weights is refused instead of training on top of other frozen weights. Not a cryptographic digest: any other
    checkpoint differs in these sums."""
    flat = [(_dotted(path), x) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]]
    if not flat:
        return {}
    stats = jax.jit(
        lambda xs: [jax.numpy.stack([(f := x.astype("float32")).sum(), (f * f).sum(), abs(f).sum()]) for x in xs]
    )
    values = stats([x for _, x in flat])
    from core.distributed import to_host

    return {name: [float(v) for v in to_host(value)] for (name, _), value in zip(flat, values)}


def check_frozen(saved: dict | None, ours: dict[str, list[float]], where: str, prefix: str = "") -> None:
    """Refuse frozen weights other than those a checkpoint was trained beside (`saved`, its record), naming the
    first tensors that differ; `prefix`: where `ours` sits in the checkpoint's tree. A sum taken in another order
    (another mesh or process count) differs by float32 rounding of its terms' sizes, not of the sum: the sum of
    +-weights cancels, so it is compared within 1e-4 of the sum of their absolute values (the record's third
    number), the sum of squares within 1e-4 of itself."""
    if saved is None:
        return
    diffs = []
    for name, (total, squares, magnitude) in ours.items():
        theirs = saved.get(prefix + name)
        if theirs is None:
            diffs.append(f"{prefix + name}: not in the checkpoint's record")
            continue
        for mine, recorded, scale in ((total, theirs[0], magnitude), (squares, theirs[1], squares)):
            if abs(mine - recorded) > 1e-4 * scale + 1e-6:
                diffs.append(f"{prefix + name}: sum {theirs[0]:.6g} / {theirs[1]:.6g} there, {total:.6g} / "
                             f"{squares:.6g} here")  # fmt: skip
                break
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint {where} was trained beside other frozen weights (the module tree's non-trainable part, "
            f"read from where the run's config points, changed since): "
            + "; ".join(diffs[:5])
            + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
        )


def _saved_meta(step_dir: Path) -> dict:
    path = step_dir / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointMismatch(f"checkpoint {step_dir}: its meta ({path}) cannot be read: {err}") from None


def _restore_subtree(item: Path, prefix: list[str], target: dict, mesh) -> dict:
    """The subtree at `prefix` of a saved params item, restored into `target`'s shapes and shardings (the rest of
    the item, such as a method's feature projections, is read replicated and dropped)."""
    from jax.sharding import NamedSharding, PartitionSpec

    with ocp.StandardCheckpointer() as ckptr:
        if not prefix:
            return ckptr.restore(item, _abstract(target))
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # the item has no step metadata of its own (the manager's step holds it)
        try:
            saved = ckptr.metadata(item).item_metadata.tree  # {path: ArrayMetadata (shape, dtype)}
        finally:
            absl.setLevel(level)
        replicated = NamedSharding(mesh, PartitionSpec())
        full = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated), dict(saved))
        node = full
        for key in prefix[:-1]:
            node = node[key]
        node[prefix[-1]] = _abstract(target)
        restored = ckptr.restore(item, full)
    for key in prefix:
        restored = restored[key]
    return restored


def load_model_from(path: str | Path, mesh=None, dtype: str = "float32"):
    """A model from an HF directory (config.json + safetensors), a Hugging Face Hub model id (`core.hub`: through
    the Hub cache; a local path of that name wins), a Temper run / checkpoint directory (with its adapters, if it
    trained LoRA adapters) or a PEFT adapter directory (its base with the adapters merged in)."""
    from core.hf import load_hf
    from core.hub import resolve_model
    from core.peft import is_adapter_dir, model_with_adapters, read_adapter

    p = resolve_model(str(path))
    if (p / "config.json").exists():
        model, _ = load_hf(p, dtype=dtype, mesh=mesh)
        return model
    if is_adapter_dir(p):
        from core.mesh import single_device_mesh
        from core.models.adapters import merged_model

        lora = read_adapter(p).lora
        return merged_model(model_with_adapters(str(p), lora, mesh or single_device_mesh(), 0, dtype))
    if p.exists():
        model, _, _ = load_checkpoint_model(p, mesh=mesh)
        return model
    raise MissingPath(f"{path}: neither an HF directory (config.json), a PEFT adapter nor a Temper checkpoint")


C = TypeVar("C", bound=Config)


def initial_model(cfg: C, mesh) -> tuple[Any, C]:
    """Where every method's run starts: `checkpoint.init_from` (an HF directory or a Temper run / checkpoint,
    whose shape wins over `model.*`) or a random init of `model.*`. Returns the model on `mesh` and the config
    with the model section it actually has."""
    from core.models import create_model
    from core.models.adapters import merged_model

    lora = cfg.model.lora
    with jax.set_mesh(mesh):
        if cfg.checkpoint.init_from is None:
            return create_model(cfg.model, mesh, seed=cfg.run.seed), cfg
        try:
            if lora is not None:
                from core.peft import model_with_adapters

                init, seed, dtype = cfg.checkpoint.init_from, cfg.run.seed, cfg.model.param_dtype
                model = model_with_adapters(init, lora, mesh, seed, dtype)
            else:
                model = merged_model(load_model_from(cfg.checkpoint.init_from, mesh, dtype=cfg.model.param_dtype))
        except MissingPath as e:
            raise MissingPath(f"checkpoint.init_from: {e}") from None
    return model, cfg.model_copy(update={"model": model.cfg})
