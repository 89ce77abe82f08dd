"""Process-level CPU settings: the KV cache on transparent huge pages (engine/cpu_runtime.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kv_cache import allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping in /proc/self/smaps that contains ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_kv_cache_is_zeroed_and_on_huge_pages() -> None:
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this host")
    caches = allocate_kv_cache(2, 512, 16, 4, 64, torch.float32)  # 8 MiB per tensor
    for k, v in caches:
        assert k.shape == v.shape == (512, 16, 4, 64)
        assert not k.any() and not v.any()
    k = caches[0][0]
    huge = _huge_kib_at(k.data_ptr() + k.numel() * k.element_size() // 2)
    assert huge >= 2048, f"no huge page under the KV cache (AnonHugePages {huge} kB)"
