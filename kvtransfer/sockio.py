"""Socket helpers for tcp and torch: exact reads straight into tensor memory (``MSG_WAITALL``), gathered bounded
writes (``sendmsg``), non-blocking control replies, and the receiver that serves each accepted connection on a
thread of its own.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvtransfer.io_cpus import start_io_thread
from kvtransfer.landing import LandingReceiver


def recv_exact(sock: socket.socket, mv: memoryview, stop: threading.Event, at_boundary: bool = False) -> None:
    """Fill ``mv`` from ``sock`` (one ``MSG_WAITALL`` call on a blocking socket); raises ``ConnectionError`` on EOF
    (saying whether it came mid-frame) and ``InterruptedError`` when stopped."""
    off, n = 0, len(mv)
    while off < n:
        try:
            got = sock.recv_into(mv[off:], n - off, socket.MSG_WAITALL)
        except TimeoutError:
            if stop.is_set():
                raise InterruptedError("stopped") from None
            continue
        if got == 0:
            if stop.is_set():
                raise InterruptedError("stopped")
            clean = at_boundary and off == 0
            raise ConnectionError("peer closed the connection" + ("" if clean else f" mid-frame ({off}/{n} bytes)"))
        off += got


IOV_CHUNK = 512  # buffers per sendmsg call, under Linux's IOV_MAX of 1024


def send_vectored(sock: socket.socket, buffers: Sequence[bytes | memoryview], deadline: float) -> int:
    """Send ``buffers`` gathered (``sendmsg``) before ``deadline``; returns the bytes sent. Any error leaves the
    stream unusable, so the caller drops the connection."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = i = 0
    while i < len(pending):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed during the send")
        sock.settimeout(remaining)
        sent = sock.sendmsg(pending[i : i + IOV_CHUNK])
        total += sent
        while i < len(pending) and sent >= len(pending[i]):  # whole buffers sent
            sent -= len(pending[i])
            i += 1
        if sent:  # the rest of a buffer the call ended in
            pending[i] = pending[i][sent:]
    return total


def tune(sock: socket.socket, timeout_s: float | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)


def join_all(threads: Sequence[threading.Thread], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))


def close_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class Connection:
    """A connection to one peer whose small control replies (ACK, FAIL) are sent without ever blocking: the caller
    may be the lease reaper, and a peer that does not drain its socket is broken, so the connection is cut."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        tune(sock, None)
        self.sock, self.peer = sock, peer
        self.send_lock = threading.Lock()

    def send_control(self, data: bytes) -> None:
        with self.send_lock:
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent != len(data):
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # the reading thread sees EOF and fails what it carried
                raise ConnectionError(f"control frame to {self.peer} would block; connection cut")

    def close(self) -> None:
        close_socket(self.sock)


class ListeningReceiver(LandingReceiver):
    """Accepts connections (``connection_cls``) and serves each on a thread of its own (tcp, torch). A subclass
    calls :meth:`_listen` and supplies ``_serve``, which reads from a connection until it ends or raises."""

    connection_cls: ClassVar[type[Connection]] = Connection

    def _listen(self, host: str, port: int) -> int:
        """Start accepting on ``host:port`` (0: ephemeral); returns the port."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[Any] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(self.config.io_timeout_s)
        self._spawn(self._accept_loop, f"kv-{self.backend_name}-accept")
        return int(self._listener.getsockname()[1])

    def _spawn(self, target: Callable[..., object], name: str, *args: object) -> None:
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(start_io_thread(self.config.io_cpus, target, name, *args))

    def _serve(self, conn: Any) -> None:
        raise NotImplementedError

    def _watchdog(self) -> None:
        """Called between accepts (every ``io_timeout_s`` at most)."""

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            self._watchdog()
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn = self.connection_cls(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._run, f"kv-{self.backend_name}-recv-{conn.peer}", conn)

    def _run(self, conn: Any) -> None:
        """Serve ``conn``; once it ends, close it and fail every request it carried, saying why."""
        reason = "receiver closed"
        try:
            self._serve(conn)
        except InterruptedError:
            pass
        except Exception as e:  # EOF (a killed sender's kernel closes its socket cleanly), a reset, a bad frame
            reason = f"sender connection lost: {e}".splitlines()[0]
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
            for entry in self.book.entries():
                if conn in entry.ctx.peers:
                    self.book.fail(entry, f"receiver: {reason} from {conn.peer}")

    def close(self) -> None:
        self._stop.set()
        close_socket(self._listener)
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            c.close()
        join_all(threads, self.config.close_timeout_s)
        self.book.stop(self.config.close_timeout_s / 4)
