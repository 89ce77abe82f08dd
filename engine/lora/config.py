"""The engine's LoRA settings: the adapters it may serve by name, and how many stay resident at once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")


@dataclass(slots=True, frozen=True)
class LoRAConfig:
    """``adapters``: (name, PEFT adapter directory) pairs; ``max_loras``: adapters kept loaded (LRU beyond it)."""

    adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique, got {names}")
        for name, path in self.adapters:
            check_adapter_name(name)
            if not Path(path).is_dir():
                raise ValueError(f"adapter {name!r}: {path} is not a directory")


def check_adapter_name(name: str) -> None:
    """ValueError unless ``name`` is letters, digits, '.', '_' or '-' (starting with a letter or digit)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r} must be letters, digits, '.', '_' or '-'")


def parse_lora_flag(value: str) -> tuple[str, str]:
    """``NAME=DIR`` as given to ``--lora``."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=DIR, got {value!r}")
    return name, path
