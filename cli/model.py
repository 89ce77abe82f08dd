"""Which checkpoint a command serves: a directory, a Hugging Face id found in the local cache, or, with no
``--model``, the built-in tiny model, generated once (deterministically) under ``$TANDEM_HOME``.

Here, in the composition root, so that the control plane and the benches are handed a checkpoint directory and
need neither the engine's model lookup nor the tiny-model generator.
"""

from __future__ import annotations

from pathlib import Path

from controlplane.local_cluster import say
from controlplane.paths import DEFAULT_MODEL_DIR


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory to serve; raises FileNotFoundError for a ``--model`` that is not one."""
    from engine.model_source import resolve_checkpoint

    if not model:
        return DEFAULT_MODEL_DIR
    return resolve_checkpoint(model)  # a directory, or a Hugging Face id found in the local cache


def ensure_model(model: str | None) -> Path:
    """:func:`resolve_model`, generating the built-in tiny model on first use (the only step here needing torch)."""
    path = resolve_model(model)
    if not (path / "config.json").is_file():
        from tinymodel.checkpoint import write_tiny_checkpoint

        say(f"generating the built-in tiny model in {path}")
        write_tiny_checkpoint(path)
    return path


def hub_id(model: str | None) -> str | None:
    """``model`` when it named a Hugging Face id (served under that name, as vLLM does), else None."""
    from engine.model_source import looks_like_hub_id

    return model if model and looks_like_hub_id(model) and not Path(model).expanduser().exists() else None
