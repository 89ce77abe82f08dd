"""TCP sender: one connection per receiver, a single worker thread streams each queued layer as frames.
Design and failure semantics: :mod:`kvtransfer.tcp`."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import ClassVar, cast

from auth.tls_socket import DuplexTLS
from kvtransfer.base import OnFailed
from kvtransfer.book import Entry
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.outgoing import Leg
from kvtransfer.queued_sender import QueuedSender
from kvtransfer.sockio import byte_view, close_socket, join_all, recv_exact, send_vectored, staged, tune
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, control, unpack

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Link:
    endpoint: str
    sock: socket.socket
    legs: dict[int, tuple[Entry, Leg]] = field(default_factory=dict)
    alive: bool = True


@dataclass(eq=False)
class _LinkWrites:
    deadline: float
    buffers: list[bytes | memoryview] = field(default_factory=list)
    sent_layers: list[tuple[Entry, Leg, int]] = field(default_factory=list)


@dataclass(eq=False)
class _Writes:
    """What one round of the worker sends, per connection, in queue order; bounded by the earliest deadline."""

    links: dict[_Link, _LinkWrites] = field(default_factory=dict)

    def add(self, link: _Link, buffers: list[bytes | memoryview], deadline: float) -> _LinkWrites:
        w = self.links.get(link)
        if w is None:
            w = self.links[link] = _LinkWrites(deadline)
        w.deadline = min(w.deadline, deadline)
        w.buffers += buffers
        return w


class TcpSender(QueuedSender):
    backend_name: ClassVar[str] = "tcp"
    cannot_reach: ClassVar[str] = "cannot connect to receiver"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self._links: dict[str, _Link] = {}
        self._worker = start_io_thread(self.config.io_cpus, self._work, "kv-tcp-send")
        self.book.start(self.config)

    def close(self) -> None:
        self._stop.set()
        self._queue.put(("stop", None, None))
        with self._lock:
            links = list(self._links.values())
        for link in links:
            close_socket(link.sock)
        join_all([self._worker, *self._threads], self.config.close_timeout_s)
        self.book.stop(self.config.close_timeout_s / 4)

    # ---- connections
    def _peer(self, endpoint: str) -> _Link:
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None and link.alive:
                return link
        host, port = endpoint.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=self.config.connect_timeout_s)
        cfg = self.config
        if cfg.tls_client is not None:  # mutual TLS: DuplexTLS stands in for the socket (auth/tls_socket.py)
            try:
                tls = DuplexTLS.connect(sock, cfg.tls_client, cfg.tls_server_name or host, cfg.connect_timeout_s)
            except OSError:
                close_socket(sock)
                raise
            sock = cast(socket.socket, tls)
        tune(sock, self.config.io_timeout_s)  # the worker re-arms the timeout to each request's deadline
        link = _Link(endpoint, sock)
        with self._lock:
            self._links[endpoint] = link
        t = start_io_thread(self.config.io_cpus, self._read, f"kv-tcp-ack-{endpoint}", link)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        return link

    def _drop(self, link: _Link, reason: str) -> None:
        with self._lock:
            link.alive = False
            if self._links.get(link.endpoint) is link:
                del self._links[link.endpoint]
        close_socket(link.sock)
        self._fail_legs(link, f"sender: {reason} ({link.endpoint})")

    def _read(self, link: _Link) -> None:
        header = bytearray(HEADER_SIZE)
        try:
            while not self._stop.is_set():
                recv_exact(link.sock, memoryview(header), self._stop, at_boundary=True)
                frame = unpack(header)
                payload = bytearray(frame.payload_len)
                if frame.payload_len:
                    recv_exact(link.sock, memoryview(payload), self._stop)
                self._on_reply(link, frame, payload)
        except InterruptedError:
            return
        except (OSError, ValueError) as e:
            self._drop(link, f"receiver connection lost (peer closed or killed): {e}")

    # ---- worker: the only thread that writes to sender sockets
    def _work(self) -> None:
        while not self._stop.is_set():
            batch = self._next_batch()
            if batch is None:
                continue
            writes = _Writes()
            try:
                for op, arg, extra in batch:
                    if op == "stop":
                        return
                    if op == "control":
                        writes.add(arg, [extra], time.monotonic() + self.config.connect_timeout_s)  # type: ignore[arg-type]
                    elif op == "layer":
                        rid, layer = cast(tuple[str, int], arg)
                        if extra is not None:
                            extra.synchronize()  # type: ignore[attr-defined]
                        self._gather_layer(writes, rid, layer)
                    elif op == "finish":
                        self._gather_finish(writes, arg)  # type: ignore[arg-type]
            except InterruptedError:
                return
            except Exception:  # never let one request kill the worker
                log.exception("kv tcp sender: building writes failed")
            finally:
                self._flush(writes)

    def _flush(self, writes: _Writes) -> None:
        """One gathered ``sendmsg`` run per connection, then the per-layer progress of what went out."""
        for link, w in writes.links.items():
            if not link.alive:
                continue
            try:
                send_vectored(link.sock, w.buffers, w.deadline)
            except (OSError, TimeoutError) as e:
                self._drop(link, f"receiver connection lost (peer closed or killed): {e}")
                continue
            for entry, leg, nbytes in w.sent_layers:
                self.out.leg_sent_layer(entry, leg, nbytes)

    def _gather_layer(self, writes: _Writes, request_id: str, layer: int) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        k, v = self.out.kv_caches[layer]
        for leg in entry.ctx.legs:
            buffers: list[bytes | memoryview] = []
            nbytes = 0
            for p in leg.pieces:
                for kv, t in enumerate((k, v)):
                    buffers.append(Frame(Kind.DATA, leg.dest.transfer_id, layer, kv, p.dst_start, p.num_blocks,
                                         p.dst_heads[0], p.dst_heads[1], p.nbytes).pack())
                    src = self.out.source_bytes(layer, kv, p)
                    buffers.append(src if src is not None else byte_view(staged(p.src_view(t))))
                    nbytes += p.nbytes
            writes.add(leg.peer, buffers, entry.deadline).sent_layers.append((entry, leg, nbytes))

    def _gather_finish(self, writes: _Writes, request_id: str) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        entry.ctx.finish_requested = True
        for leg in entry.ctx.legs:
            writes.add(leg.peer, [control(Kind.FINISH, leg.dest.transfer_id)], entry.deadline)
