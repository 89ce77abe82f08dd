"""Process-level CPU settings (engine/cpu_runtime.py): the KV cache on transparent huge pages, and the CPU vendor
that picks the few-row fp32 GEMM (engine/models/layers.py ``linear``)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cpu_runtime import cpu_vendor
from engine.models import layers

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
    """In a fresh interpreter, as a worker allocates its cache at start: in this long-lived test process, memory that
    earlier tests freed (and the allocator kept) may be reused already faulted in small pages."""
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this host")
    code = (
        "import torch, tests.test_cpu_runtime as t\n"
        "from engine.kv_cache import allocate_kv_cache\n"
        "caches = allocate_kv_cache(2, 512, 16, 4, 64, torch.float32)  # 8 MiB per tensor\n"
        "for k, v in caches:\n"
        "    assert k.shape == v.shape == (512, 16, 4, 64)\n"
        "    assert not k.any() and not v.any()\n"
        "k = caches[0][0]\n"
        "print(t._huge_kib_at(k.data_ptr() + k.numel() * k.element_size() // 2))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    huge = int(out.stdout.strip().splitlines()[-1])
    assert huge >= 2048, f"no huge page under the KV cache (AnonHugePages {huge} kB)"


def test_cpu_vendor_is_read_from_proc_cpuinfo() -> None:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        assert cpu_vendor() == ""
        return
    want = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                 if line.startswith("vendor_id")), "")
    assert cpu_vendor() == want
    limit = layers._MKL_GEMV_MAX_WEIGHT
    assert limit == math.inf if want == "GenuineIntel" else limit == 1 << 18


@pytest.mark.skipif(not layers._ONEDNN, reason="needs torch's oneDNN (mkldnn) ops")
@pytest.mark.parametrize("limit", [1 << 18, float("inf")])
def test_few_row_fp32_matmuls_take_mkl_only_under_the_weight_limit(monkeypatch: pytest.MonkeyPatch,
                                                                  limit: float) -> None:
    """One- and two-row fp32 matmuls go to torch's default GEMM (MKL) below ``_MKL_GEMV_MAX_WEIGHT`` elements and
    to oneDNN's packed call from it on (the non-Intel limit), or always to MKL (Intel's); the results agree."""
    monkeypatch.setattr(layers, "_MKL_GEMV_MAX_WEIGHT", limit)
    plain = torch.nn.functional.linear
    mkl_calls: list[tuple[int, ...]] = []

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        mkl_calls.append(tuple(w.shape))
        return plain(x, w, b)

    monkeypatch.setattr(layers.F, "linear", counting)
    torch.manual_seed(0)
    small, large = torch.randn(256, 256) * 0.02, torch.randn(1024, 768) * 0.02  # 64k and 768k elements
    for w in (small, large):
        layers.prepack_linear_weight(w)
    for rows in (1, 2):
        mkl_calls.clear()
        for w in (small, large):
            x = torch.randn(rows, w.shape[1])
            torch.testing.assert_close(layers.linear(x, w), plain(x, w), rtol=1e-5, atol=1e-6)
        assert mkl_calls == ([(256, 256)] if limit < float("inf") else [(256, 256), (1024, 768)])
