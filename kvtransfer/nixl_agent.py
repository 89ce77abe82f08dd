"""NIXL plumbing shared by both ends: the agent, the DATA notification's timing stamp, the UDP doorbell and the
poll backoff. The doorbell wakes the receiver's notification watcher (NIXL has no blocking wait); a datagram
carries no data and is never trusted, so a lost one costs latency only. Design: :mod:`kvtransfer.nixl_backend`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import io_affinity
from kvtransfer.wire import HEADER_SIZE

log = logging.getLogger(__name__)
_MAX_DRAIN = 64  # doorbell datagrams read per wake: a flood cannot hold the watcher
_AGENT_CONFIG_LOCK = threading.Lock()  # make_agent swaps NIXL's config class while it builds an agent
_HANDED = struct.Struct("!Q")


def ucx_environment(config: TransferConfig) -> dict[str, str]:
    """The UCX variables an agent of ``config`` is created under (UCX reads only its environment). ``UCX_TLS`` is
    left to UCX unless configured: on one host it picks shared memory, where the *sender* copies, so decode spends
    no CPU on the bytes."""
    env = {"UCX_NET_DEVICES": config.ucx_net_devices, "UCX_TLS": config.ucx_tls}
    return {name: value for name, value in env.items() if value}


def make_agent(config: TransferConfig, role: str) -> Any:
    """A NIXL agent with the configured backends, UCX pinned to the configured devices and transports, and its
    progress thread sleeping ``nixl_progress_delay_us``: ``nixl_agent`` hard-codes ``pthrDelay = 0``, so while the
    agent is built its config class stores the configured delay instead."""
    os.environ.update(ucx_environment(config))
    nixl_api = import_nixl_api()
    name = f"tandem-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cfg = nixl_api.nixl_agent_config(enable_prog_thread=True, backends=list(config.nixl_backends))
    base, delay_us = nixl_api.nixlBind.nixlAgentConfig, config.nixl_progress_delay_us

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:
            base.pthrDelay.__set__(self, delay_us)

    with _AGENT_CONFIG_LOCK, io_affinity(config.io_cpus):  # NIXL's progress thread and UCX's start on io_cpus
        nixl_api.nixlBind.nixlAgentConfig = _DelayedConfig
        try:
            return nixl_api.nixl_agent(name, cfg)
        finally:
            nixl_api.nixlBind.nixlAgentConfig = base


class Agent:
    """A NIXL agent behind one lock (the forward thread, a progress thread and the lease reaper all call it), with
    the KV registration each end makes once and the peers it has added."""

    def __init__(self, config: TransferConfig, role: str) -> None:
        self.nixl = make_agent(config, role)
        self.name: str = self.nixl.name
        self.lock = threading.Lock()
        self.metadata = b""
        self.known: set[str] = set()  # peer agents added
        self.bases: tuple[tuple[int, int], ...] = ()  # per layer, the K and V tensors' addresses
        self.mem = ("DRAM", 0)  # NIXL memory type and device of the registered tensors
        self._reg: Any = None

    def register(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        tensors = [t for pair in kv_caches for t in pair]
        with self.lock:
            self._reg = self.nixl.register_memory(tensors)
            self.metadata = self.nixl.get_agent_metadata()
        self.bases = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        self.mem = ("VRAM", tensors[0].device.index or 0) if tensors[0].is_cuda else ("DRAM", 0)

    def add_remote(self, metadata: bytes) -> str:
        """Add the peer agent ``metadata`` describes; returns its name."""
        with self.lock:
            name = self.nixl.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.known.add(name)
        return name

    def send(self, remote: str, msg: bytes) -> None:
        with self.lock:
            self.nixl.send_notif(remote, msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self.lock:
            return self.nixl.get_new_notifs()

    def release(self, handle: Any) -> None:
        """Release a transfer handle or a prepared descriptor list. An in-flight handle may refuse; NIXL frees it
        with the agent."""
        try:
            with self.lock:
                handle.release()
        except Exception as e:
            log.debug("nixl: release of %r failed: %s", handle, e)

    def close(self) -> None:
        with self.lock:
            if self._reg is not None:
                try:
                    self.nixl.deregister_memory(self._reg)
                except Exception as e:
                    log.debug("nixl %s: deregister failed: %s", self.name, e)
                self._reg = None


def import_nixl_api() -> Any:
    """``nixl._api``, with NIXL's INFO lines moved off stdout (they would corrupt a worker's READY line or
    ``--json`` output) to the process's logging at WARNING, unless ``NIXL_LOG_LEVEL`` says otherwise."""
    try:
        import nixl._api as nixl_api
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the nixl backend needs NIXL: pip install nixl-cu12==1.5.1 (see kvtransfer docs)") from e
    logger = logging.getLogger("nixl")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            logger.removeHandler(handler)
    logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    return nixl_api


def data_notif(header: bytes, handed_after_hello_s: float) -> bytes:
    """A layer's DATA notification: its frame header, then (8 bytes, microseconds) how long after the leg's HELLO
    that layer's compute ended, on the sender's clock (:func:`handed_after` reads it)."""
    return header + _HANDED.pack(max(0, round(handed_after_hello_s * 1e6)))


def handed_after(msg: bytes) -> float | None:
    """The seconds :func:`data_notif` appended to a DATA notification, or None (none there)."""
    if len(msg) < HEADER_SIZE + _HANDED.size:
        return None
    return _HANDED.unpack_from(msg, HEADER_SIZE)[0] / 1e6


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) → (host, port); None when ``endpoint`` is no such address."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if 0 < int(port) < 65536 else None


class Doorbell:
    """The receiving end: a non-blocking UDP socket bound to ``host`` on an ephemeral port."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind((host, 0))
        port = self._sock.getsockname()[1]
        self.rings = 0  # wakes caused by the bell (for tests and debugging)
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True (and the bell drained) when it rang."""
        try:
            ready, _, _ = select.select([self._sock], [], [], max(timeout_s, 0.0))
        except (OSError, ValueError):  # closed under us: behave as a plain sleep's end
            return False
        if not ready:
            return False
        self.rings += 1
        for _ in range(_MAX_DRAIN):
            try:
                self._sock.recv(16)
            except OSError:  # BlockingIOError: drained
                break
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class Ringer:
    """The sending end: one unbound UDP socket per address family, shared by every destination."""

    def __init__(self) -> None:
        self._socks: dict[socket.AddressFamily, socket.socket] = {}
        self._lock = threading.Lock()  # rung from the progress thread and from the forward thread

    def ring(self, address: tuple[str, int] | None) -> None:
        """Send one datagram to ``address`` (None: the receiver has no bell); never raises, never blocks."""
        if address is None:
            return
        fam = _family(address[0])
        with contextlib.suppress(OSError):  # unreachable, buffer full, closed: the receiver's polling finds the layer
            with self._lock:
                sock = self._socks.get(fam)
                if sock is None:
                    sock = self._socks[fam] = socket.socket(fam, socket.SOCK_DGRAM)
                    sock.setblocking(False)
            sock.sendto(b"\x01", address)

    def close(self) -> None:
        with self._lock:
            socks, self._socks = list(self._socks.values()), {}
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


class Backoff:
    """A poll sleep that doubles every tick, from ``min_s`` up to ``max_s``, until ``reset``."""

    def __init__(self, max_s: float, min_s: float = 5e-5) -> None:
        self.min_s, self.max_s, self._cur = min_s, max_s, min_s

    def reset(self) -> None:
        self._cur = self.min_s

    def next_timeout(self, cap_s: float | None = None) -> float:
        """This tick's sleep (at most ``cap_s`` when given); the next one is twice as long (capped)."""
        cur = self._cur if cap_s is None else min(self._cur, cap_s)
        self._cur = min(cur * 2, self.max_s)
        return cur
