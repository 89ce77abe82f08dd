"""Shared fixtures: deterministic tiny checkpoints (written once per session) and engine block-accounting checks."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import cli.main  # noqa: F401  (before anything imports grpc: gRPC's fork support off, as in every tandem process)
from controlplane.local_cluster import ray_env_defaults

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Local Ray clusters as tandem up starts them (no token auth, 120 s for the GCS port: Ray's 30 s ran out once in
# CI right after another cluster's teardown), and UCX (NIXL) over loopback: what .ci/run sets, so that the README's
# plain `python3 -m pytest -q` runs the same way.
ray_env_defaults()
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end or heavyweight test (still runs in CI)")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(arch)`` → path of the tiny checkpoint for ``arch``, generated on first use."""
    from tinymodel.checkpoint import write_tiny_checkpoint

    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch=arch)
        return cache[arch]

    return get


class HFGreedy:
    """transformers' greedy continuations (float32, one prompt at a time, no padding), cached per prompt."""

    def __init__(self) -> None:
        self.models: dict[Path, object] = {}
        self.cache: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}

    def __call__(self, path: Path, prompt: list[int], max_new: int) -> list[int]:
        import torch
        from transformers import AutoModelForCausalLM

        key = (path, tuple(prompt), max_new)
        if key not in self.cache:
            if path not in self.models:
                self.models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model = self.models[path]
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,  # type: ignore[attr-defined]
                                     min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]


@pytest.fixture(scope="session")
def hf_greedy() -> HFGreedy:
    return HFGreedy()
