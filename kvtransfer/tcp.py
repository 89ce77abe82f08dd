"""TCP backend: framed messages over one persistent connection per (sender, receiver) pair, optionally mutual TLS.

The sender gathers a request's frames (HELLO, each piece's DATA header with a memoryview of the source blocks as
payload, FINISH) into one ``sendmsg`` run per connection. With ``TransferConfig.native_io`` (the default, where the
C extension ``kvtransfer/tcp_pump.c`` builds, and without TLS) the caller's thread gathers them and hands them to the
connection's native thread, which writes them without the GIL: no Python thread is woken per layer. Otherwise
the items are queued for the sender's Python worker thread, which gathers everything queued and writes it. The
receiver validates each header against the reservation and ``recv_into``s the payload straight into the reserved
blocks, then answers ACK. A dropped connection fails every request on it at once; a sender stalled mid-payload past
its lease is cut by the receiver's watchdog, so no read blocks forever.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, cast

import torch

from auth.tls_socket import DuplexTLS
from kvtransfer.book import Entry, OnFailed
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import io_affinity
from kvtransfer.layout import flat_bytes
from kvtransfer.outgoing import Leg, PeerWrites, QueuedSender
from kvtransfer.plan import Piece
from kvtransfer.sockio import Connection, ListeningReceiver, close_socket, recv_exact, send_vectored, tune
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, unpack

log = logging.getLogger(__name__)
_SCRATCH = 1 << 20


def pump_module() -> ModuleType | None:
    """The native writer (``kvtransfer/tcp_pump.c``), built once per host and interpreter; None where it cannot
    be (native code off, no compiler or headers): the Python worker writes instead."""
    from native.extension import load_python_extension

    return load_python_extension("kvtransfer._tcp_pump", Path(__file__).with_name("tcp_pump.c"), ("-pthread",))


def discard(sock: socket.socket, n: int, stop: threading.Event, scratch: memoryview) -> None:
    while n > 0:
        chunk = min(n, len(scratch))
        recv_exact(sock, scratch[:chunk], stop)
        n -= chunk


@dataclass(eq=False)
class _Link:
    endpoint: str
    sock: socket.socket
    legs: dict[int, tuple[Entry, Leg]] = field(default_factory=dict)
    alive: bool = True
    pump: Any = None  # the connection's native writer (kvtransfer._tcp_pump.Pump), or None

    def replies(self, stop: threading.Event) -> list[tuple[Frame, bytearray]]:
        header = bytearray(HEADER_SIZE)
        recv_exact(self.sock, memoryview(header), stop, at_boundary=True)
        frame = unpack(header)
        payload = bytearray(frame.payload_len)
        recv_exact(self.sock, memoryview(payload), stop)
        return [(frame, payload)]

    def close(self) -> None:
        if self.pump is not None:  # shut down first, so a send in progress ends; the fd is closed after the join
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.pump.close()
        close_socket(self.sock)


class TcpSender(QueuedSender):
    backend_name: ClassVar[str] = "tcp"
    cannot_reach: ClassVar[str] = "cannot connect to receiver"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        cfg = config or TransferConfig()
        module = pump_module() if cfg.native_io and cfg.tls_client is None else None
        self._pump_cls: Any = getattr(module, "Pump", None)
        self._inline = False  # set at register(): items are handled on the caller's thread (CPU caches, native)
        self._submit_lock = threading.RLock()  # re-entered when a failed push fails requests and tells peers
        super().__init__(cfg, on_failed)

    @property
    def native(self) -> bool:
        """Whether this sender's connections are written by native threads."""
        return self._pump_cls is not None

    def register(self, kv_caches: Any, layout: Any) -> None:
        super().register(kv_caches, layout)
        self._inline = self.native and all(not k.is_cuda and not v.is_cuda for k, v in kv_caches)

    def _submit(self, item: tuple[str, Any, Any]) -> None:
        """Natively written CPU caches: gather on the caller's thread and hand the frames to the connection's
        native thread (a few microseconds, no wake-up of a Python thread); else queued for the worker (CUDA
        caches wait for their layer's event there)."""
        if not self._inline:
            super()._submit(item)
            return
        with self._submit_lock:
            self._handle([item])

    def _connect(self, endpoint: str) -> _Link:
        host, port = endpoint.rsplit(":", 1)
        cfg = self.config
        sock = socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s)
        if cfg.tls_client is not None:  # mutual TLS: DuplexTLS stands in for the socket (auth/tls_socket.py)
            try:
                tls = DuplexTLS.connect(sock, cfg.tls_client, cfg.tls_server_name or host, cfg.connect_timeout_s)
            except OSError:
                close_socket(sock)
                raise
            sock = cast(socket.socket, tls)
        tune(sock, cfg.io_timeout_s)  # the worker re-arms the timeout to each request's deadline
        link = _Link(endpoint, sock)
        if self._pump_cls is not None:
            with io_affinity(cfg.io_cpus):  # a new thread starts with its creator's CPU mask
                link.pump = self._pump_cls(sock.fileno())
        return link

    def _flush(self, writes: dict[Any, PeerWrites]) -> None:
        """One gathered ``sendmsg`` run per connection (natively: handed to its thread, which writes it before the
        earliest deadline or cuts the connection), then the per-layer progress of what went out (natively: of what
        was handed to the transport)."""
        for link, w in writes.items():
            if not link.alive:
                continue
            try:
                if link.pump is None:
                    send_vectored(link.sock, w.frames, w.deadline)
                elif not link.pump.push(w.frames, w.deadline):
                    raise ConnectionError(link.pump.state()[2] or "connection closed")
            except (OSError, TimeoutError) as e:
                self._drop(link, f"receiver connection lost (peer closed or killed): {e}")
                continue
            for entry, leg, nbytes in w.layers:
                self.out.leg_sent_layer(entry, leg, nbytes)

    def _payload(self, w: PeerWrites, layer: int, kv: int, piece: Piece, t: torch.Tensor) -> None:
        """Right after its header, in one iovec list: a memoryview of the source blocks (no copy for full-head
        pieces on CPU; else a contiguous CPU copy of the slice)."""
        src = self.out.run_bytes(layer, kv, piece.src_start, piece.src_heads[1] - piece.src_heads[0], piece.nbytes)
        w.frames.append(src if src is not None else flat_bytes(piece.src_view(t).to("cpu").contiguous()))


class _Inbound(Connection):
    writing: Entry | None = None  # the request whose payload is being received right now


class TcpReceiver(ListeningReceiver):
    backend_name: ClassVar[str] = "tcp"
    connection_cls = _Inbound

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self.endpoint = f"{self.config.host}:{self._listen(self.config.host, self.config.port)}"
        self.book.start(self.config)

    def _watchdog(self) -> None:
        """A sender stalled mid-payload past the lease: cut its connection so the blocked read ends."""
        now = time.monotonic()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            entry = c.writing
            if entry is not None and now > entry.deadline + self.config.io_timeout_s:
                log.warning("kv tcp receiver: %s stalled mid-payload past its lease; closing", c.peer)
                with contextlib.suppress(OSError):
                    c.sock.shutdown(socket.SHUT_RDWR)

    def _serve(self, conn: _Inbound) -> None:
        tls = self.config.tls_server
        if tls is not None:  # mutual TLS first, in this connection's thread: a stalled handshake holds only it
            try:
                conn.sock = cast(socket.socket, DuplexTLS.accept(conn.sock, tls, self.config.connect_timeout_s))
            except OSError as e:  # ssl.SSLError included: no client certificate, or one from another CA
                log.warning("kv tcp receiver: TLS handshake with %s refused: %s", conn.peer, e)
                raise
        header = bytearray(HEADER_SIZE)
        scratch = memoryview(bytearray(_SCRATCH))
        while not self._stop.is_set():
            recv_exact(conn.sock, memoryview(header), self._stop, at_boundary=True)
            frame = unpack(header)
            if frame.kind == Kind.DATA:
                self._data(conn, frame, scratch)
                continue
            payload = bytearray(frame.payload_len)
            recv_exact(conn.sock, memoryview(payload), self._stop)
            self._control_frame(frame, bytes(payload), conn)

    def _data(self, conn: _Inbound, frame: Frame, scratch: memoryview) -> None:
        entry = self._live(frame.transfer_id)
        if entry is None or not self.book.begin_write(entry):
            discard(conn.sock, frame.payload_len, self._stop, scratch)
            return
        try:
            if not self._admit(entry, frame):
                discard(conn.sock, frame.payload_len, self._stop, scratch)
                return
            conn.writing = entry
            direct = self.landing.run_bytes(frame.layer, frame.kv, frame.dst_start, frame.head_hi - frame.head_lo,
                                            frame.payload_len)
            if direct is not None:
                recv_exact(conn.sock, direct, self._stop)
            else:
                view = self._view(frame)
                staging = torch.empty(view.shape, dtype=view.dtype)
                recv_exact(conn.sock, flat_bytes(staging), self._stop)
                view.copy_(staging)
        finally:
            conn.writing = None
            self.book.end_write(entry)
        self._landed(entry, frame)
