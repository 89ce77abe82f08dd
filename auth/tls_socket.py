"""A TLS connection that one thread reads while another writes (the worker's session port: a reader thread and a
writer thread per connection).

OpenSSL forbids using one SSL object from two threads at once, and a blocking ``SSLSocket`` would hold it for the
whole wait. So the socket is non-blocking, each ``recv`` and ``send`` runs under a lock, and the waiting (``poll``)
happens outside it: a writer blocked on a full send buffer never keeps the reader from draining the peer, which
would deadlock two such peers. The handshake runs in the connection's own thread with a deadline, so a client that
connects and sends nothing holds one thread for ``handshake_timeout_s`` at most and never the accept loop.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
from typing import Any

_POLL_S = 0.5  # a wait is cut into slices of this, to notice close() from another thread


class DuplexTLS:
    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def accept(cls, raw: socket.socket, ctx: ssl.SSLContext, handshake_timeout_s: float = 10.0) -> DuplexTLS:
        """Run the server side of the handshake on ``raw`` (an accepted connection); ``ssl.SSLError`` if the
        client's certificate is missing or not from the CA, ``OSError``/``TimeoutError`` if it stalls."""
        raw.settimeout(handshake_timeout_s)
        tls = ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        tls.do_handshake()
        return cls(tls)

    @property
    def raw(self) -> socket.socket:
        return self._sock

    def peer_subject(self) -> str:
        cert: dict[str, Any] = dict(self._sock.getpeercert() or {})
        return ",".join(f"{k}={v}" for rdn in cert.get("subject", ()) for k, v in rdn)

    def recv(self, n: int) -> bytes:
        """Up to ``n`` bytes; b"" once the peer has closed (or this side was closed)."""
        while True:
            with self._lock:
                if self._closed:
                    return b""
                try:
                    return self._sock.recv(n)
                except ssl.SSLWantReadError:
                    readable = True
                except ssl.SSLWantWriteError:
                    readable = False
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return b""
            self._wait(readable)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
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
            self._wait(readable)

    def _wait(self, readable: bool) -> None:
        with contextlib.suppress(OSError, ValueError):  # closed under it: the caller's next try says so
            p = select.poll()
            p.register(self._sock.fileno(), select.POLLIN if readable else select.POLLOUT)
            p.poll(_POLL_S * 1000)

    def close(self) -> None:
        """Shut the connection down from any thread: a reader or writer waiting on it returns or raises."""
        self._closed = True
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        with self._lock, contextlib.suppress(OSError):
            self._sock.close()
