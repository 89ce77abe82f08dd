"""Shared fixtures: deterministic tiny checkpoints (written once per session) and engine block-accounting checks."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end or heavyweight test (still runs in CI)")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(arch)`` → path of the tiny checkpoint for ``arch``, generated on first use."""
    from engine.tiny_model import write_tiny_checkpoint

    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch=arch)
        return cache[arch]

    return get
