"""torch.distributed backend: a 2-rank process group (gloo on CPU, NCCL on CUDA) per (sender, receiver) pair.

The receiver hosts a ``TCPStore`` (its endpoint) and a control listener published in it; a sender claims a pair
index with ``store.add``, connects to the listener naming that index, and both build the group over a
``PrefixStore``. Wire frames travel on the control connection, payloads as ``send``/``recv`` on the group, straight
into the reserved blocks. Control is a socket, not a standing ``recv``, because a blocked gloo ``wait`` cannot be
interrupted by ``close()`` and a timed-out one closes the pair. On CPU this is slower than tcp; it is kept for NCCL.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore, TCPStore

from kvtransfer.base import KVCaches
from kvtransfer.book import Entry, OnFailed
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import io_affinity
from kvtransfer.layout import KVLayout
from kvtransfer.outgoing import Leg, PeerWrites, QueuedSender
from kvtransfer.plan import Piece
from kvtransfer.sockio import Connection, ListeningReceiver, recv_exact, send_vectored
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, unpack

PAIRS_KEY = "tandem/pairs"
CONTROL_KEY = "tandem/control"  # the receiver's control listener, host:port
TAG = 0


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_group(store: Any, rank: int, cuda: bool, timeout_s: float, host: str, io_cpus: tuple[int, ...] = ()) -> Any:
    """A 2-rank process group on ``store``: NCCL for CUDA tensors, gloo otherwise, bound to ``host``: the local
    address of the pair's control connection, which the other end has just reached. The library threads it starts
    (gloo's device loop, which reads every received byte, and its work threads) run on ``io_cpus``."""
    with io_affinity(io_cpus):
        if cuda:  # pragma: no cover - needs a GPU
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timedelta_s(timeout_s)
            return ProcessGroupNCCL(store, rank, 2, opts)
        from torch.distributed import ProcessGroupGloo

        gopts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gopts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        gopts._timeout = timedelta_s(timeout_s)
        return ProcessGroupGloo(store, rank, 2, gopts)


def split_frames(blob: bytes) -> list[tuple[Frame, bytes]]:
    """Frames of one store message; control payloads are inline, DATA payloads come through the group."""
    out: list[tuple[Frame, bytes]] = []
    off = 0
    while off < len(blob):
        frame = unpack(blob[off : off + HEADER_SIZE])
        inline = 0 if frame.kind == Kind.DATA else frame.payload_len
        out.append((frame, blob[off + HEADER_SIZE : off + HEADER_SIZE + inline]))
        off += HEADER_SIZE + inline
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_LEN = struct.Struct("!I")
PAIR_INDEX = struct.Struct("!Q")  # a control connection's first message: the pair index its sender claimed
MAX_MESSAGE = 64 << 20  # a control message is wire frames: a layer's DATA headers at most, far below this


class ControlLink(Connection):
    """A pair's control channel: length-prefixed messages of wire frames both ways over one TCP connection. One
    thread reads (blocking; ends on EOF or ``close``); writes are serialised and bounded, and any error cuts it."""

    def put(self, blob: bytes, deadline: float) -> None:
        with self.send_lock:
            try:
                send_vectored(self.sock, [_LEN.pack(len(blob)), blob], deadline)
            except OSError:
                self.close()
                raise

    def send_control(self, data: bytes) -> None:
        super().send_control(_LEN.pack(len(data)) + data)

    def get(self, stop: threading.Event) -> bytes:
        size = bytearray(_LEN.size)
        recv_exact(self.sock, memoryview(size), stop, at_boundary=True)
        (n,) = _LEN.unpack(size)
        if n > MAX_MESSAGE:
            raise ValueError(f"control message of {n} bytes from {self.peer} is too large")
        blob = bytearray(n)
        recv_exact(self.sock, memoryview(blob), stop)
        return bytes(blob)


def store_client(endpoint: str, timeout_s: float) -> TCPStore:
    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timedelta_s(timeout_s), wait_for_workers=False)


@dataclass(eq=False)
class _OutPair:
    endpoint: str
    store: Any
    group: Any
    link: ControlLink
    legs: dict[int, tuple[Entry, Leg]] = field(default_factory=dict)
    alive: bool = True

    def replies(self, stop: threading.Event) -> list[tuple[Frame, bytes]]:
        return split_frames(self.link.get(stop))

    def close(self) -> None:
        self.link.close()


class TorchSender(QueuedSender):
    """Joins the receiver's store, ``send``s each queued layer's block runs, completes on ACK."""

    backend_name: ClassVar[str] = "torch"
    cannot_reach: ClassVar[str] = "cannot form a group with"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        self._inflight: list[tuple[_OutPair, list[Any], PeerWrites]] = []  # read by the worker: set before it starts
        super().__init__(config, on_failed)

    def _connect(self, endpoint: str) -> _OutPair:
        cfg = self.config
        store = store_client(endpoint, cfg.connect_timeout_s)
        index = int(store.add(PAIRS_KEY, 1)) - 1
        host, port = bytes(store.get(CONTROL_KEY)).decode().rsplit(":", 1)
        link = ControlLink(socket.create_connection((host, int(port)), cfg.connect_timeout_s), endpoint)
        try:
            link.put(PAIR_INDEX.pack(index), time.monotonic() + cfg.connect_timeout_s)
            cuda = bool(self.out.kv_caches) and self.out.kv_caches[0][0].is_cuda
            group = make_group(PrefixStore(f"tandem/pair/{index}", store_client(endpoint, cfg.connect_timeout_s)),
                               1, cuda, cfg.connect_timeout_s, link.sock.getsockname()[0], cfg.io_cpus)
        except Exception:
            link.close()
            raise
        return _OutPair(endpoint, store, group, link)

    def _idle(self) -> None:
        self._complete()  # nothing queued behind: wait for the layers in flight

    def _payload(self, w: PeerWrites, layer: int, kv: int, piece: Piece, t: torch.Tensor) -> None:
        w.payloads.append(as_bytes(piece.src_view(t).contiguous()))

    def _flush(self, writes: dict[Any, PeerWrites]) -> None:
        """Per pair: one control message (every frame gathered, in queue order), then its payloads' ``send``s."""
        for pair, w in writes.items():
            if not pair.alive:
                continue
            try:
                pair.link.put(b"".join(w.frames), w.deadline)
                works = [pair.group.send([buf], 0, TAG) for buf in w.payloads]  # the receiver is rank 0
            except Exception as e:
                self._drop(pair, f"receiver connection lost (peer closed or killed): {e}")
                continue
            # Completed later (_complete), so the next message and its sends overlap these payloads.
            self._inflight.append((pair, works, w))

    def _complete(self) -> None:
        while self._inflight:
            pair, works, w = self._inflight.pop(0)
            try:
                for work in works:
                    work.wait()
            except Exception as e:
                self._drop(pair, f"receiver connection lost (peer closed or killed): {e}")
                continue
            for entry, leg, nbytes in w.layers:
                self.out.leg_sent_layer(entry, leg, nbytes)


class TorchReceiver(ListeningReceiver):
    """Hosts the store and a control listener, forms a group per sender, ``recv``s payloads into the reserved
    blocks."""

    backend_name: ClassVar[str] = "torch"
    connection_cls = ControlLink

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        cfg = self.config
        with io_affinity(cfg.io_cpus):  # the store server's thread
            self._store: Any = TCPStore(cfg.host, cfg.port, None, True, timedelta_s(cfg.connect_timeout_s),
                                        wait_for_workers=False)
        self.endpoint = f"{cfg.host}:{self._store.port}"
        self._served: set[int] = set()  # pair indices that connected: each is served once
        self._cuda = False
        self._store.set(CONTROL_KEY, f"{cfg.host}:{self._listen(cfg.host, 0)}")
        self.book.start(cfg)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)
        self._cuda = kv_caches[0][0].is_cuda

    def close(self) -> None:
        super().close()
        self._store = None  # the last reference to the master: its server shuts down

    def _serve(self, link: ControlLink) -> None:
        """One sender: its first message names the pair it claimed in the store; then its layers, in order."""
        cfg = self.config
        first = link.get(self._stop)
        (index,) = PAIR_INDEX.unpack(first) if len(first) == PAIR_INDEX.size else (-1,)
        with self._lock:
            if not 0 <= index < int(self._store.add(PAIRS_KEY, 0)) or index in self._served:
                raise ValueError(f"{link.peer} named no pair it claimed, or one already connected ({first[:16]!r})")
            self._served.add(index)
        # The group gets a store client of its own: TCPStore clients are not safe for concurrent use.
        group_store = PrefixStore(f"tandem/pair/{index}", store_client(self.endpoint, cfg.connect_timeout_s))
        group = make_group(group_store, 0, self._cuda, cfg.connect_timeout_s, link.sock.getsockname()[0],
                           cfg.io_cpus)
        while not self._stop.is_set():
            data: list[Frame] = []  # a run of DATA headers: their recvs are posted together
            for frame, payload in split_frames(link.get(self._stop)):
                if frame.kind == Kind.DATA:
                    data.append(frame)
                    continue
                if data:
                    self._data(group, data)
                    data = []
                self._control_frame(frame, payload, link)
            if data:
                self._data(group, data)

    def _data(self, group: Any, frames: list[Frame]) -> None:
        """Receive one message's payloads, every ``recv`` posted before any wait. Each announced payload is received,
        but written into the reserved blocks only while the lease is live and the header checks out."""
        device = "cuda" if self._cuda else "cpu"
        slots: list[tuple[Frame, Entry | None, torch.Tensor | None, torch.Tensor]] = []
        try:
            for frame in frames:
                entry = self._live(frame.transfer_id)
                if entry is not None and not self.book.begin_write(entry):
                    entry = None
                if entry is not None and not self._admit(entry, frame):
                    self.book.end_write(entry)
                    entry = None
                view = None if entry is None else self._view(frame)
                if view is not None and view.is_contiguous():
                    target = as_bytes(view)
                else:
                    target = torch.empty(frame.payload_len, dtype=torch.uint8, device=device)
                slots.append((frame, entry, view, target))
            works = [group.recv([target], 1, TAG) for _, _, _, target in slots]
            for w in works:
                w.wait()
            if self._cuda:  # pragma: no cover - needs a GPU
                torch.cuda.current_stream().synchronize()
            for _, _, view, target in slots:
                if view is not None and not view.is_contiguous():
                    view.copy_(target.view(view.dtype).view(view.shape))
        finally:
            for _, entry, _, _ in slots:
                if entry is not None:
                    self.book.end_write(entry)
        for frame, entry, _, _ in slots:
            if entry is not None:
                self._landed(entry, frame)
