"""Where a ``--model`` lives: a checkpoint directory, or a Hugging Face id (``org/name``) found in the local
Hugging Face cache.

A hub id is resolved with ``huggingface_hub.snapshot_download(local_files_only=True)``: the cache's
``models--org--name/snapshots/<revision>`` folder that ``refs/main`` (or the given revision) names, with no network
access at all; serving never downloads. The cache is ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read when the call is made. A model found in neither place raises
:class:`ModelNotFoundError` with a one-line message saying where it was looked for.
"""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """Neither a checkpoint directory nor a hub id present in the local cache."""


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    return home / "hub"


def looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model


def resolve_checkpoint(model: str, revision: str | None = None) -> Path:
    """The checkpoint directory (holding ``config.json``) that ``model`` names."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if not looks_like_hub_id(model) or path.exists():
        raise ModelNotFoundError(f"{path / 'config.json'} not found: --model must be an HF checkpoint directory "
                                 "or a Hugging Face id (org/name) in the local Hugging Face cache")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    where = cache / f"models--{model.replace('/', '--')}" / "snapshots"
    try:
        snapshot = Path(snapshot_download(model, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as e:  # ValueError: an id huggingface_hub refuses to parse
        raise ModelNotFoundError(f"model {model!r} is not a checkpoint directory and not in the Hugging Face cache "
                                 f"(looked for {path.resolve()} and {where}); download it first, e.g. `hf download "
                                 f"{model}`: serving never downloads ({type(e).__name__})") from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"{snapshot} (model {model!r} in the Hugging Face cache) has no config.json")
    return snapshot
