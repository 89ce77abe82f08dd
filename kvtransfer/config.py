"""Tunables for every backend, in one frozen config (no environment variables, except where UCX insists)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TransferConfig:
    """``host``/``port`` are where a receiver listens (port 0 → ephemeral). Times are seconds."""

    host: str = "127.0.0.1"
    port: int = 0
    poll_interval_s: float = 0.002  # background threads' idle tick (lease checks, notification polling)
    io_timeout_s: float = 0.2  # socket/store wait slice; threads re-check stop and deadlines between slices
    connect_timeout_s: float = 10.0  # handshake bound: connecting, forming a process group
    close_timeout_s: float = 1.0  # close() joins its threads within this
    ucx_net_devices: str = "lo"  # NIXL/UCX: UCX_NET_DEVICES
    ucx_tls: str = ""  # NIXL/UCX: UCX_TLS, e.g. "tcp,self"; "" leaves UCX's own choice
    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_progress_delay_us: int = 100  # NIXL's progress thread's idle sleep (its API's 0 spins on a whole core)
    io_cpus: tuple[int, ...] = ()  # CPUs for every thread the transport starts (kvtransfer.io_cpus)
    # TCP backend: each connection's writes run on a native thread (kvtransfer/tcp_pump.c) that never takes the GIL,
    # handed over on the caller's thread; False, or where it cannot build (TANDEM_NATIVE_KERNELS=0, no compiler,
    # TLS), the Python worker thread writes them.
    native_io: bool = True
    # TCP backend: mutual TLS (auth/tls.py builds both contexts from --tls-*); ``tls_client`` checks the receiver
    # against ``tls_server_name`` (None: the host dialled). Both None: plain TCP (loopback ``tandem up``).
    tls_server: ssl.SSLContext | None = None
    tls_client: ssl.SSLContext | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("TransferConfig.host must be non-empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"TransferConfig.port {self.port} out of range")
        for name in ("poll_interval_s", "io_timeout_s", "connect_timeout_s", "close_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0")
        if self.poll_interval_s > self.close_timeout_s / 4 or self.io_timeout_s > self.close_timeout_s / 2:
            raise ValueError("TransferConfig poll/io slices must be well under close_timeout_s so close() is prompt")
        if self.nixl_progress_delay_us < 0:
            raise ValueError("TransferConfig.nixl_progress_delay_us must be >= 0")
        if any(not isinstance(c, int) or c < 0 for c in self.io_cpus):
            raise ValueError(f"TransferConfig.io_cpus must be CPU numbers >= 0, got {self.io_cpus!r}")
        if (self.tls_server is None) != (self.tls_client is None):
            raise ValueError("TransferConfig needs tls_server and tls_client together (mutual TLS), or neither")
        if not self.nixl_backends:
            raise ValueError("TransferConfig.nixl_backends must name at least one NIXL backend")
