"""TCP receiver: listens, validates each frame against the lease, ``recv_into``s payloads into the reserved
blocks. Design and failure semantics: :mod:`kvtransfer.tcp`."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, cast

import torch

from auth.tls_socket import DuplexTLS
from kvtransfer.base import KVCaches, OnFailed
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.landing import Landing
from kvtransfer.layout import KVLayout
from kvtransfer.sockio import (
    PeerClosed,
    byte_view,
    close_socket,
    discard,
    join_all,
    recv_exact,
    send_nowait,
    tune,
)
from kvtransfer.stream_receiver import StreamReceiver
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, control, parse_hello, unpack

log = logging.getLogger(__name__)
_SCRATCH = 1 << 20


@dataclass(eq=False)
class _Inbound:
    sock: socket.socket
    peer: str
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    writing: Entry | None = None  # the request whose payload is being received right now

    def send_control(self, data: bytes) -> None:
        """Send a small control frame without ever blocking (the caller may be the lease reaper); a peer that
        does not drain its socket is broken, so the connection is cut instead of stalling this thread."""
        with self.send_lock:
            if not send_nowait(self.sock, data):
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                raise ConnectionError(f"control frame to {self.peer} would block; connection cut")


class TcpReceiver(StreamReceiver):
    backend_name: ClassVar[str] = "tcp"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        cfg = self.config
        self.book = TransferBook("receiver", on_failed, self._notify_peer)
        self.landing = Landing(self.book, self.backend_name)
        self._stop = threading.Event()
        self._listener = socket.create_server((cfg.host, cfg.port))
        self._listener.settimeout(cfg.io_timeout_s)
        self.endpoint = f"{cfg.host}:{self._listener.getsockname()[1]}"
        self._conns: set[_Inbound] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._spawn(self._accept_loop, "kv-tcp-accept")
        self.book.start(cfg)

    def _spawn(self, target: Callable[..., object], name: str, *args: object) -> None:
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(start_io_thread(self.config.io_cpus, target, name, *args))

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)

    def close(self) -> None:
        self._stop.set()
        close_socket(self._listener)
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            close_socket(c.sock)
        join_all(threads, self.config.close_timeout_s)
        self.book.stop(self.config.close_timeout_s / 4)

    # ---- threads
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            self._watchdog()
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            tune(sock, None)
            conn = _Inbound(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, f"kv-tcp-recv-{conn.peer}", conn)

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
        header = bytearray(HEADER_SIZE)
        scratch = memoryview(bytearray(_SCRATCH))
        reason = "receiver closed"
        tls = self.config.tls_server
        if tls is not None:  # mutual TLS first, in this connection's thread: a stalled handshake holds only it
            try:
                conn.sock = cast(socket.socket, DuplexTLS.accept(conn.sock, tls, self.config.connect_timeout_s))
            except OSError as e:  # ssl.SSLError included: no client certificate, or one from another CA
                log.warning("kv tcp receiver: TLS handshake with %s refused: %s", conn.peer, e)
                close_socket(conn.sock)
                with self._lock:
                    self._conns.discard(conn)
                return
        try:
            while not self._stop.is_set():
                recv_exact(conn.sock, memoryview(header), self._stop, at_boundary=True)
                self._dispatch(conn, unpack(header), scratch)
        except PeerClosed as e:  # a SIGKILLed peer's kernel closes its socket cleanly: same as a close
            reason = f"sender connection lost (peer closed or killed): {e}"
        except InterruptedError:
            reason = "receiver closed"
        except (OSError, ValueError) as e:
            reason = f"sender connection broken: {e}"
        finally:
            close_socket(conn.sock)
            with self._lock:
                self._conns.discard(conn)
            for entry in self.book.entries():
                if conn in entry.ctx.peers:
                    self.book.fail(entry, f"receiver: {reason} from {conn.peer}")

    def _dispatch(self, conn: _Inbound, frame: Frame, scratch: memoryview) -> None:
        if frame.kind == Kind.DATA:
            self._data(conn, frame, scratch)
            return
        payload = bytearray(frame.payload_len)
        if frame.payload_len:
            recv_exact(conn.sock, memoryview(payload), self._stop)
        entry = self.landing.live(frame.transfer_id)
        if entry is None:
            if frame.kind == Kind.HELLO:  # unknown or expired lease: say so instead of letting the sender wait
                conn.send_control(control(Kind.FAIL, frame.transfer_id, b"receiver: no live reservation for this "
                                          b"transfer (released or lease expired)"))
            return
        if frame.kind == Kind.HELLO:
            try:
                self.landing.on_hello(entry, parse_hello(bytes(payload)), conn)
            except ValueError as e:
                with self.book.lock:
                    if conn not in entry.ctx.peers:
                        entry.ctx.peers.append(conn)
                self.book.fail(entry, f"receiver: {e}", notify_peer=True)
        elif frame.kind == Kind.FINISH:
            self.landing.on_finish(entry)
        elif frame.kind == Kind.FAIL:
            self.book.fail(entry, f"receiver: sender reported: {payload.decode(errors='replace')}")

    def _data(self, conn: _Inbound, frame: Frame, scratch: memoryview) -> None:
        entry = self.landing.live(frame.transfer_id)
        if entry is None or not self.book.begin_write(entry):
            discard(conn.sock, frame.payload_len, self._stop, scratch)
            return
        try:
            try:
                self.landing.check(entry, frame)
            except ValueError as e:
                self.book.fail(entry, f"receiver: refused DATA: {e}", notify_peer=True)
                discard(conn.sock, frame.payload_len, self._stop, scratch)
                return
            conn.writing = entry
            direct = self.landing.byte_range(frame)
            if direct is not None:
                recv_exact(conn.sock, direct, self._stop)
            else:
                view = self.landing.view(frame)
                staging = torch.empty(view.shape, dtype=view.dtype)
                recv_exact(conn.sock, byte_view(staging), self._stop)
                view.copy_(staging)
        finally:
            conn.writing = None
            self.book.end_write(entry)
        if self.landing.landed(entry, frame.layer, frame.payload_len):
            for peer in list(entry.ctx.peers):
                with contextlib.suppress(OSError):
                    peer.send_control(control(Kind.ACK, frame.transfer_id))

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for peer in list(entry.ctx.peers):
            with contextlib.suppress(OSError):
                peer.send_control(control(Kind.FAIL, entry.ctx.transfer_id, message.encode()))
