"""Models and datasets named by Hugging Face Hub id, resolved through `huggingface_hub` and its cache.

    path = resolve_model("Qwen/Qwen2.5-0.5B-Instruct")          # a local directory (config, weights, tokenizer)
    path = resolve_dataset("trl-lib/ultrafeedback_binarized")    # the dataset repository's files, read by `datasets`

A local path always wins: an id is looked up on the Hub only when no file or directory of that name exists.
`huggingface_hub.snapshot_download` downloads into its cache (`HF_HUB_CACHE`, `HF_HOME`) or, with
`HF_HUB_OFFLINE=1`, serves what the cache already holds; an id it cannot find is a `MissingPath` saying which and
how to fix it. Models download their config, weights and tokenizer files only (`MODEL_FILES`); run directories
never name code to import (`trust_remote_code` is never set).
"""

from __future__ import annotations

import re
from pathlib import Path

from core.errors import MissingPath

# `org/name` (an optional revision is not supported: pin by downloading it).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def looks_like_hub_id(name: str) -> bool:
    """`org/name` that is not a local path (a local path of that name wins)."""
    return bool(_HUB_ID.match(name)) and not Path(name).exists()


def _snapshot(repo_id: str, repo_type: str, allow_patterns: list[str] | None, what: str) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, repo_type=repo_type, allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        raise MissingPath(
            f"{what} {repo_id!r}: not a local path, and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) while offline (HF_HUB_OFFLINE=1) or without network: "
            f"download it first (`hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}`) "
            f"or give a local path"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise MissingPath(f"{what} {repo_id!r}: cannot be fetched from the Hugging Face Hub ({err})") from None


def resolve_model(name: str, what: str = "model") -> Path:
    """The local directory of a model: `name` itself when it exists, else the Hub snapshot of that id."""
    if Path(name).exists() or not looks_like_hub_id(name):
        return Path(name)
    return _snapshot(name, "model", MODEL_FILES, what)


def resolve_dataset(name: str) -> Path:
    """The local path of a dataset: `name` itself when it exists, else the Hub snapshot of that dataset id."""
    if Path(name).exists() or not looks_like_hub_id(name):
        return Path(name)
    return _snapshot(name, "dataset", None, "data.source")
