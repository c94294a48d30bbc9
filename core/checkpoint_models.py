"""Models read out of checkpoints and directories, and the fingerprint of a run's frozen parameters.

    model, cfg, meta = load_checkpoint_model(run_dir / "checkpoints" / "4")   # the trained model a checkpoint holds
    model, cfg = load_model_from(path, mesh)        # an HF directory, a Hub id, a Temper run or checkpoint
    model, cfg = initial_model(cfg, mesh)           # `checkpoint.init_from`, or a fresh model
    save_params(path, params); load_params(path, target)                     # parameters alone

Reading never imports user code: a checkpoint's saved config is read as data (`core.checkpoint.saved_config`), and
only its model section is validated.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from flax import nnx

from core.checkpoint import abstract_tree, dotted_path, pure_state, saved_config
from core.config import Config, ModelConfig
from core.errors import CheckpointMismatch, MissingPath

# ----------------------------------------------------------- params only


def save_params(path: str | Path, params: nnx.State) -> Path:
    """Write parameters alone (e.g. for evaluation or as an SFT starting point)."""
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, pure_state(params), force=True)
    return path


def load_params(path: str | Path, target: nnx.State) -> nnx.State:
    """Read parameters written by `save_params` into the shardings of `target`."""
    path = Path(path).absolute()
    if not path.exists():
        raise MissingPath(f"no parameter checkpoint at {path}")
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract_tree(pure_state(target)))
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
        nnx.replace_by_pure_dict(params, _restore_subtree(step_dir / "params", prefix, pure_state(params), mesh))
        return nnx.merge(graphdef, params), model_cfg, saved
    base_path = (saved.get("checkpoint") or {}).get("init_from")
    if base_path is None:
        raise CheckpointMismatch(
            f"checkpoint {step_dir} holds LoRA adapters of a randomly initialised base (checkpoint.init_from was "
            f"not set): there is no base to read them onto"
        )
    from core.hf.peft import model_with_adapters

    model = model_with_adapters(base_path, model_cfg.lora, mesh, seed=0, dtype=model_cfg.param_dtype)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)  # type: ignore[misc]
    meta = _saved_meta(step_dir)
    check_frozen(meta.get(FROZEN), frozen_fingerprint(rest), str(step_dir), "".join(f"{k}." for k in prefix))
    nnx.replace_by_pure_dict(adapters, _restore_subtree(step_dir / "params", prefix, pure_state(adapters), mesh))
    return nnx.merge(graphdef, adapters, rest), model.cfg, saved


TRAINED_MODEL = "trained_model"  # meta key: where the trained model sits in the checkpoint's trainable tree
FROZEN = "frozen_fingerprint"  # meta key: what the frozen part of the module tree was (`frozen_fingerprint`)


def frozen_fingerprint(state: Any) -> dict[str, list[float]]:
    """{dotted path: [sum, sum of squares, sum of absolute values]} of every array of a frozen state (the module
    tree's non-trainable part), in float32 over the whole array whatever its sharding (a collective in a process
    group): what a checkpoint records of the weights it does not hold, so that a resume or a later load on other
    weights is refused instead of training on top of other frozen weights. Not a cryptographic digest: any other
    checkpoint differs in these sums."""
    flat = [(dotted_path(path), x) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]]
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
            return ckptr.restore(item, abstract_tree(target))
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
        node[prefix[-1]] = abstract_tree(target)
        restored = ckptr.restore(item, full)
    for key in prefix:
        restored = restored[key]
    return restored


def load_model_from(path: str | Path, mesh=None, dtype: str = "float32"):
    """A model from an HF directory (config.json + safetensors), a Hugging Face Hub model id (`core.hf.hub`: through
    the Hub cache; a local path of that name wins), a Temper run / checkpoint directory (with its adapters, if it
    trained LoRA adapters) or a PEFT adapter directory (its base with the adapters merged in)."""
    from core.hf.directory import load_hf
    from core.hf.hub import resolve_model
    from core.hf.peft import is_adapter_dir, model_with_adapters, read_adapter

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
                from core.hf.peft import model_with_adapters

                init, seed, dtype = cfg.checkpoint.init_from, cfg.run.seed, cfg.model.param_dtype
                model = model_with_adapters(init, lora, mesh, seed, dtype)
            else:
                model = merged_model(load_model_from(cfg.checkpoint.init_from, mesh, dtype=cfg.model.param_dtype))
        except MissingPath as e:
            raise MissingPath(f"checkpoint.init_from: {e}") from None
    return model, cfg.model_copy(update={"model": model.cfg})
