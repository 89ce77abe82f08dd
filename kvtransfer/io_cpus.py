"""Which CPUs the KV transport's own threads run on (``TransferConfig.io_cpus``).

Whatever thread copies landing bytes spends CPU; on decode's cores that is time taken from the forward pass.
Python threads pin themselves as they start (:func:`start_io_thread`); threads that C++ libraries create (gloo,
NIXL, UCX) are created inside :func:`io_affinity`, since a new Linux thread starts with its creator's mask.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)
_PR_SET_NAME = 15
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def parse_cpu_list(spec: str) -> tuple[int, ...]:
    """``"0,2-3"`` → ``(0, 2, 3)``: the Linux cpu-list syntax (as ``taskset -c`` and cgroup cpusets take it)."""
    cpus: set[int] = set()
    for part in filter(None, map(str.strip, spec.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad CPU list {spec!r}: {part!r} is not a CPU number or a range a-b") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list {spec!r}: {part!r} is not a CPU number or an ascending range")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"bad CPU list {spec!r}: it names no CPU")
    return tuple(sorted(cpus))


def check_cpus(cpus: tuple[int, ...]) -> None:
    """Raise ``ValueError`` if this process cannot run threads on ``cpus``: a CPU the host does not have, or one
    its cgroup cpuset leaves out (a Kubernetes CPU-manager pod, ``docker --cpuset-cpus``), found by pinning a
    short-lived thread there. Checked once, at start-up, so a wrong flag fails the worker's start."""
    have = os.cpu_count() or 1
    missing = [c for c in cpus if c >= have]
    if missing:
        raise ValueError(f"KV I/O CPUs {missing} do not exist on this host (CPUs 0-{have - 1})")
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-io-cpu-check") as pool:
        error = pool.submit(os.sched_setaffinity, 0, cpus).exception()  # pins only that short-lived thread
    if isinstance(error, OSError):
        raise ValueError(f"KV I/O CPUs {list(cpus)} cannot be used by this process ({error.strerror}); "
                         "are they outside its cgroup cpuset?")


@contextlib.contextmanager
def io_affinity(cpus: tuple[int, ...]) -> Iterator[None]:
    """Run the body on ``cpus``, so any thread it creates (in Python or C++) starts there; then restore."""
    if not cpus:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def start_io_thread(cpus: tuple[int, ...], target: Callable[..., object], name: str,
                    *args: object) -> threading.Thread:
    """Start a daemon thread running ``target(*args)`` on ``cpus`` (where its creator runs when empty), named
    ``name`` in the OS too (``top -H``, ``ps -L``; first 15 bytes, best effort). A refused pin (the CPUs left the
    cpuset after start-up) is logged and the thread runs unpinned: a transport thread that did not start would
    stall every transfer."""

    def run() -> None:
        if _LIBC is not None:
            with contextlib.suppress(OSError, AttributeError):
                _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as e:
                log.warning("kv I/O thread %s could not be pinned to CPUs %s (%s); running unpinned", name,
                            list(cpus), e.strerror)
        target(*args)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t
