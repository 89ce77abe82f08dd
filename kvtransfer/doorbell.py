"""A UDP doorbell: lets a NIXL sender wake the receiver's notification watcher instead of waiting out its sleep.

NIXL has no blocking wait for notifications, so the receiver polls ``get_new_notifs`` on a schedule that keeps
decode's CPU free (:meth:`kvtransfer.nixl_receiver.NixlReceiver._watch`). A short transfer can land entirely
inside one of those sleeps (measured: a 1 MiB request landed ~0.8 ms after ``start`` and was seen ~2.4 ms after,
at the receiver's next 2 ms tick). When the sender has seen its last layer's WRITE complete, it rings; the watcher
sleeps in ``select`` on the bell, so it wakes at once and polls.

The bell is only a hint: a datagram carries no data and is never trusted (anyone who can reach the port can at
most cause an early poll, and the watcher drains a bounded number per wake). A lost or late datagram costs nothing
but the latency it would have saved; correctness stays with the NIXL notifications and the leases.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_MAX_DRAIN = 64  # datagrams read per wake: a flood cannot hold the watcher


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
        try:
            with self._lock:
                sock = self._socks.get(fam)
                if sock is None:
                    sock = self._socks[fam] = socket.socket(fam, socket.SOCK_DGRAM)
                    sock.setblocking(False)
            sock.sendto(b"\x01", address)
        except OSError:  # unreachable, buffer full, closed: the receiver's polling still finds the layer
            pass

    def close(self) -> None:
        with self._lock:
            socks, self._socks = list(self._socks.values()), {}
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
