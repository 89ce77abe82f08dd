"""Process-level CPU settings the engine applies once at start-up.

glibc's malloc returns every large block (over 128 KiB by default, adaptively more) straight to the kernel with
``munmap``, so each prefill step's activation tensors are fresh ``mmap`` regions whose pages fault in one by one.
Raising the mmap and trim thresholds keeps freed arenas in the process and reuses them: measured here, a
32x128-token prefill on the tiny model went from ~215-265 ms to ~135-170 ms, and decode steps from ~6.5 to ~4.5 ms.
tcmalloc or jemalloc via ``LD_PRELOAD`` achieve the same, but need packages and a re-exec; this needs neither.

Large long-lived tensors (the KV cache, the weights) are put on transparent huge pages where the kernel allows it:
Linux's common default THP mode is ``madvise``, so :func:`empty_on_huge_pages` asks with ``MADV_HUGEPAGE`` before
the memory is first touched. Measured on the tiny model (32 sequences, 1 GiB KV cache): 5.3k → 6.6k tok/s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_configured = False


def configure_cpu_runtime(num_threads: int | None = None) -> None:
    """Idempotent. ``num_threads`` sets torch's intra-op threads (default: torch's choice, one per core)."""
    global _configured
    if num_threads:
        torch.set_num_threads(num_threads)
    if _configured:
        return
    _configured = True
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc (musl, macOS): nothing to tune
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    if not ok:
        log.debug("mallopt refused the thresholds; keeping the defaults")


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on CPU whose whole 2 MiB pages are advised as huge before first use (best effort).

    Tensors under one huge page gain nothing and are returned as they are. The kernel may still decline (THP
    ``never``, no free huge pages): the tensor is the same either way.
    """
    t = torch.empty(shape, dtype=dtype)
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and hi > lo and madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return t


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...) from ``/proc/cpuinfo``; "" elsewhere.

    Some kernel choices depend on it: MKL dispatches its fast code paths on Intel CPUs only (see
    ``engine.models.layers.linear``)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
