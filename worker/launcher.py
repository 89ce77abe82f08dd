"""Start ``tandem worker`` processes on loopback and wait until they are ready; stop them by PID.

Workers inherit this process's cluster token (auth/token.py, created here if there is none yet), so the router,
tests and benches started from the same process can call their admin RPCs."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from auth.token import ensure_cluster_token

# glibc's malloc on transparent huge pages (glibc >= 2.35; elsewhere the variable is ignored). Where the kernel's THP
# mode is ``madvise`` (the common default), an engine's weights, oneDNN's packed copies of them and its activations
# otherwise sit on 4 KiB pages, and a memory-bound decode step pays a TLB miss every 4 KiB of weights it streams.
# Measured on this project's AMD EPYC VM (docs/benchmarks.md §1): small-llama fp32 single-sequence decode 36.0 ->
# 29.8 ms a step, bf16 20.4-20.8 -> 17.1-17.5 ms a token; batch-32 decode and the tiny model (cache-resident)
# unchanged. Only read when a process starts, so it goes into the environment of every engine process Tandem
# starts, and the CLI's own engine commands re-exec once to get it (``cli.main``). A GLIBC_TUNABLES that already
# names it wins (``=0`` turns it off).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
_ADDED_MARK = "TANDEM_ADDED_MALLOC_TUNABLE"  # set where Tandem added the tunable, so a peer's env can drop it again


def huge_page_malloc_supported() -> bool:
    """Whether this process's C library has the tunable: glibc 2.35 or newer."""
    lib, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    try:
        return lib == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        return False


def with_huge_page_malloc(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``glibc.malloc.hugetlb=1`` added to GLIBC_TUNABLES, unless it names that tunable already."""
    out = dict(env)
    tunables = out.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == HUGE_PAGE_TUNABLE for t in tunables.split(":")):
        return out
    out["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}=1" if tunables else f"{HUGE_PAGE_TUNABLE}=1"
    out[_ADDED_MARK] = "1"
    return out


def without_added_huge_page_malloc(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the tunable :func:`with_huge_page_malloc` added (a benchmark's peer runs as its own users
    run it); a tunable the user set stays."""
    out = dict(env)
    if out.pop(_ADDED_MARK, None) != "1":
        return out
    kept = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t and t != f"{HUGE_PAGE_TUNABLE}=1"]
    if kept:
        out["GLIBC_TUNABLES"] = ":".join(kept)
    else:
        out.pop("GLIBC_TUNABLES", None)
    return out


@dataclass(slots=True)
class WorkerProcess:
    role: str
    proc: subprocess.Popen[str]
    port: int
    log: list[str] = field(default_factory=list)
    metrics_port: int = 0  # its /metrics (``--metrics-port``, printed as ``METRICS PORT`` before READY); 0: none

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: the failure tests' way to make a worker die mid-flight."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


KV_BACKENDS = ("auto", "nixl", "torch", "tcp")


def resolve_kv_backend(name: str) -> str:
    """The KV transfer backend a worker starts with. ``auto``: NIXL where it is installed, else the TCP fallback.

    NIXL is the backend with the least decode-side cost (docs/benchmarks.md §2): across hosts UCX moves the bytes
    by RDMA, and between processes on one host by shared memory, copied by the sending process. Checked with
    ``find_spec`` so that choosing costs no import (``tandem up`` and ``tandem down`` stay free of torch and NIXL).
    """
    if name not in KV_BACKENDS:
        raise ValueError(f"unknown KV backend {name!r} (choose from {', '.join(KV_BACKENDS)})")
    if name != "auto":
        return name
    return "nixl" if importlib.util.find_spec("nixl") is not None else "tcp"


def start_worker(role: str, model: str, kv_backend: str = "tcp", extra: list[str] | None = None,
                 timeout_s: float = 120.0, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None) -> WorkerProcess:
    """Start a worker and wait for its READY line. ``cpus`` pins the process, and so every thread it will start
    (engine, OpenMP, gRPC, UCX), to those CPUs, as separate hosts or a kubelet CPU set would keep tiers apart."""
    cmd = [sys.executable, "-m", "cli.main", "worker", "--role", role, "--model", model, "--port", "0",
           "--kv-backend", resolve_kv_backend(kv_backend), *(extra or [])]
    ensure_cluster_token()
    full_env = with_huge_page_malloc({**os.environ, "UCX_NET_DEVICES": "lo", **(env or {})})
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            preexec_fn=pin)
    log: list[str] = []

    def drain_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if len(log) > 500:
                del log[:100]

    threading.Thread(target=drain_stderr, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    port = metrics_port = 0
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"{role} worker exited with {proc.returncode}:\n{''.join(log[-40:])}")
            time.sleep(0.01)
            continue
        if line.startswith("METRICS "):
            metrics_port = int(line.split()[1])
        if line.startswith("READY "):
            port = int(line.split()[1])
            break
    if not port:
        proc.kill()
        raise TimeoutError(f"{role} worker not ready within {timeout_s}s:\n{''.join(log[-40:])}")
    threading.Thread(target=lambda: proc.stdout.read() if proc.stdout else None, daemon=True).start()
    return WorkerProcess(role, proc, port, log, metrics_port)
