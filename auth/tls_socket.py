"""A TLS connection that one thread reads while another writes: the worker's session port (a reader and a writer
thread per connection) and the KV TCP backend (a receiving thread beside control replies from others; a sending
thread beside an acknowledgement reader).

OpenSSL forbids using one SSL object from two threads at once, and a blocking ``SSLSocket`` would hold it for the
whole wait. So the socket is non-blocking, each ``recv`` and ``send`` runs under a lock, and the waiting (``poll``)
happens outside it: a writer blocked on a full send buffer never keeps the reader from draining the peer, which
would deadlock two such peers. The handshake runs in the connection's own thread with a deadline, so a client that
connects and sends nothing holds one thread for ``handshake_timeout_s`` at most and never the accept loop.

``DuplexTLS`` stands where a ``socket.socket`` would for what those callers use: ``recv``/``recv_into`` (flags
such as ``MSG_WAITALL`` are ignored: callers loop until they have what they asked for), ``sendall``/``sendmsg``
(which sends every buffer, small ones coalesced into one record), ``send`` with ``MSG_DONTWAIT`` (one try, else
``BlockingIOError``), ``settimeout`` (a wait longer than it raises ``TimeoutError``), ``setsockopt`` and
``shutdown`` (on the TCP socket beneath, from any thread: waiters wake and see the end).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

_POLL_S = 0.5  # a wait is cut into slices of this, to notice close() from another thread
_COALESCE = 64 << 10  # buffers below this are joined before they are sent (one TLS record instead of many)


class DuplexTLS:
    def __init__(self, sock: ssl.SSLSocket, timeout_s: float | None = None) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()
        self._closed = False
        self._timeout = timeout_s

    @classmethod
    def accept(cls, raw: socket.socket, ctx: ssl.SSLContext, handshake_timeout_s: float = 10.0) -> DuplexTLS:
        """Run the server side of the handshake on ``raw`` (an accepted connection); ``ssl.SSLError`` if the
        client's certificate is missing or not from the CA, ``OSError``/``TimeoutError`` if it stalls."""
        timeout = raw.gettimeout()
        raw.settimeout(handshake_timeout_s)
        tls = ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        tls.do_handshake()
        return cls(tls, timeout)

    @classmethod
    def connect(cls, raw: socket.socket, ctx: ssl.SSLContext, server_hostname: str,
                handshake_timeout_s: float = 10.0) -> DuplexTLS:
        """Run the client side of the handshake on ``raw`` (a connected socket); ``ssl.SSLError`` if the server's
        certificate does not check, or once the server refuses this side's."""
        timeout = raw.gettimeout()
        raw.settimeout(handshake_timeout_s)
        tls = ctx.wrap_socket(raw, server_hostname=server_hostname, do_handshake_on_connect=False)
        tls.do_handshake()
        return cls(tls, timeout)

    @property
    def raw(self) -> socket.socket:
        return self._sock

    def peer_subject(self) -> str:
        cert: dict[str, Any] = dict(self._sock.getpeercert() or {})
        return ",".join(f"{k}={v}" for rdn in cert.get("subject", ()) for k, v in rdn)

    # ---- socket-like surface

    def settimeout(self, timeout_s: float | None) -> None:
        self._timeout = timeout_s

    def gettimeout(self) -> float | None:
        return self._timeout

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def fileno(self) -> int:
        return self._sock.fileno()

    def recv(self, n: int, flags: int = 0) -> bytes:
        """Up to ``n`` bytes; b"" once the peer has closed (or this side was closed)."""
        buf = bytearray(n)
        got = self.recv_into(memoryview(buf), n)
        return bytes(buf[:got])

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Up to ``nbytes`` (0: ``len(buffer)``) bytes into ``buffer``; 0 once the peer has closed."""
        view = memoryview(buffer).cast("B")
        n = nbytes or len(view)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            with self._lock:
                if self._closed:
                    return 0
                try:
                    return self._sock.recv_into(view, n)
                except ssl.SSLWantReadError:
                    readable = True
                except ssl.SSLWantWriteError:
                    readable = False
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return 0
            self._wait(readable, deadline)

    def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while view:
            with self._lock:
                if self._closed:
                    raise OSError("connection closed")
                try:
                    view = view[self._sock.send(view):]
                    continue
                except ssl.SSLWantWriteError:
                    readable = False
                except ssl.SSLWantReadError:
                    readable = True
            self._wait(readable, deadline)

    def sendmsg(self, buffers: Sequence[bytes | memoryview]) -> int:
        """Send every buffer, in order, within the timeout; the bytes sent (all of them)."""
        total = 0
        small: list[bytes | memoryview] = []
        for b in buffers:
            total += len(b)
            if len(b) < _COALESCE:
                small.append(b)
                continue
            if small:
                self.sendall(b"".join(small))
                small = []
            self.sendall(b)
        if small:
            self.sendall(b"".join(small))
        return total

    def send(self, data: bytes, flags: int = 0) -> int:
        """With ``MSG_DONTWAIT``: one try that never waits (``BlockingIOError`` if it would); else ``sendall``."""
        if not flags & socket.MSG_DONTWAIT:
            self.sendall(data)
            return len(data)
        with self._lock:
            if self._closed:
                raise OSError("connection closed")
            try:
                return self._sock.send(data)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                raise BlockingIOError("the TLS send would block") from None

    def _wait(self, readable: bool, deadline: float | None) -> None:
        if self._closed:
            return
        slice_s = _POLL_S
        if deadline is not None:
            slice_s = min(slice_s, deadline - time.monotonic())
            if slice_s <= 0:
                raise TimeoutError("timed out")
        with contextlib.suppress(OSError, ValueError):  # closed under it: the caller's next try says so
            p = select.poll()
            p.register(self._sock.fileno(), select.POLLIN if readable else select.POLLOUT)
            p.poll(slice_s * 1000)

    def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        """Shut the TCP connection beneath down (any thread): a waiting reader or writer returns or raises."""
        socket.socket.shutdown(self._sock, how)

    def close(self) -> None:
        """Shut the connection down from any thread, and close it."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.shutdown()
        with self._lock, contextlib.suppress(OSError):
            self._sock.close()
