"""Process-level CPU settings the engine applies once at start-up.

glibc's malloc returns every large block (over 128 KiB by default, adaptively more) straight to the kernel with
``munmap``, so each prefill step's activation tensors are fresh ``mmap`` regions whose pages fault in one by one.
Raising the mmap and trim thresholds keeps freed arenas in the process and reuses them: measured here, a
32x128-token prefill on the tiny model went from ~215-265 ms to ~135-170 ms, and decode steps from ~6.5 to ~4.5 ms.
tcmalloc or jemalloc via ``LD_PRELOAD`` achieve the same, but need packages and a re-exec; this needs neither.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

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
