"""The sender-side halves every backend shares: legs, plans and per-layer progress (:class:`Outbound`), and the
senders that hand layers to one background worker thread (:class:`QueuedSender`: tcp, torch).

A request has one leg per destination rank its heads go to, planned at ``start``; it is DONE when every leg's
receiver acknowledged. The worker takes everything already queued and gathers it per peer (:class:`PeerWrites`),
so a layer of many pieces, or a short request whole, goes out in a few writes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvtransfer.base import DestinationInfo, KVCaches, KVSender, TransferState
from kvtransfer.book import Entry, OnFailed, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.layout import KVLayout, RegisteredKV
from kvtransfer.plan import Piece, plan_leg
from kvtransfer.sockio import join_all
from kvtransfer.wire import Frame, Kind, control, hello_payload

log = logging.getLogger(__name__)
MAX_BATCH = 64  # queued items a worker thread takes into one round of writes


@dataclass(slots=True)
class Leg:
    dest: DestinationInfo
    pieces: list[Piece] = field(default_factory=list)
    peer: Any = None  # backend connection / agent name
    layers_sent: int = 0
    acked: bool = False


@dataclass(slots=True)
class Outgoing:
    legs: list[Leg]
    src_ids: tuple[int, ...]
    finish_requested: bool = False


class Outbound(RegisteredKV):
    """Composed by every sender: registration, start-time planning and progress accounting."""

    def __init__(self, book: TransferBook, backend: str) -> None:
        super().__init__()
        self.book = book
        self.backend = backend

    def open(self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_ids: Sequence[int],
             deadline_s: float) -> Entry:
        """Create the entry (deadline = the earlier of ours and every destination's lease)."""
        if self.layout is None:
            raise RuntimeError(f"{self.backend} sender: register() the KV caches first")
        dests = [dest] if isinstance(dest, DestinationInfo) else list(dest)
        if not dests:
            raise ValueError("start() needs at least one destination")
        for d in dests:
            if d.backend != self.backend:
                raise ValueError(f"destination is for backend {d.backend!r}, this sender is {self.backend!r}")
        ids = tuple(int(b) for b in src_ids)
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise ValueError(f"start {request_id!r}: source block id outside [0, {self.num_blocks})")
        deadline = min([deadline_s, *(d.deadline_s for d in dests)])
        entry = self.book.add(request_id, deadline, Outgoing([Leg(d) for d in dests], ids))
        entry.state = TransferState.IN_FLIGHT
        return entry

    def plan(self, entry: Entry) -> KVLayout:
        """Plan every leg of an opened entry and return this rank's layout; on a mismatch fail the entry (peer
        notified) and re-raise (``CompatibilityError``)."""
        layout, out = self.layout, entry.ctx
        assert layout is not None  # open() refuses an unregistered sender
        try:
            for leg in out.legs:
                leg.pieces = plan_leg(layout, leg.dest.layout, out.src_ids, leg.dest.dst_block_ids)
        except ValueError as e:  # CompatibilityError included: refused before any byte moves
            self.book.fail(entry, f"sender: {e}", notify_peer=True)
            raise
        return layout

    def release(self, request_id: str) -> Entry | None:
        """Fail the request if it is in flight (telling the receivers, not the owner) and forget it; its entry."""
        entry = self.book.find(request_id)
        if entry is not None:
            self.book.fail(entry, "sender: released before completion", notify_peer=True, tell_owner=False)
        self.book.pop(request_id)
        return entry

    def live(self, request_id: str) -> Entry | None:
        with self.book.lock:
            entry = self.book.find(request_id)
            return entry if entry is not None and entry.state < TransferState.DONE else None

    def leg_sent_layer(self, entry: Entry, leg: Leg, nbytes: int) -> None:
        with self.book.lock:
            leg.layers_sent += 1
            entry.nbytes += nbytes
            entry.layers_done = min(lg.layers_sent for lg in entry.ctx.legs)

    def on_reply(self, entry: Entry, leg: Leg, frame: Frame, payload: bytes | bytearray) -> None:
        """A frame the receiver sent back for ``leg``: ACK completes the leg (the request once all are), FAIL fails
        the request."""
        if frame.kind == Kind.ACK:
            with self.book.lock:
                leg.acked = True
                if all(lg.acked for lg in entry.ctx.legs):
                    self.book.done(entry)
        elif frame.kind == Kind.FAIL:
            self.book.fail(entry, f"sender: receiver reported: {bytes(payload).decode(errors='replace')}")


@dataclass(eq=False)
class PeerWrites:
    """What one round of a worker sends one peer, in queue order, bounded by the earliest of its requests'
    deadlines: wire frames (for tcp with their payloads between them), payloads sent apart (torch), and the layers
    whose progress counts once they went out."""

    deadline: float
    frames: list[bytes | memoryview] = field(default_factory=list)
    payloads: list[torch.Tensor] = field(default_factory=list)
    layers: list[tuple[Entry, Leg, int]] = field(default_factory=list)  # (entry, leg, bytes) per layer gathered


def writes_for(writes: dict[Any, PeerWrites], peer: Any, deadline: float) -> PeerWrites:
    w = writes.get(peer)
    if w is None:
        w = writes[peer] = PeerWrites(deadline)
    w.deadline = min(w.deadline, deadline)
    return w


class QueuedSender(KVSender):
    """A subclass supplies ``_connect``, ``_payload`` and ``_flush``; its peers have ``endpoint``,
    ``alive``, ``legs`` (transfer id -> the entry and leg it carries), ``replies(stop)`` (block for the receiver's
    next frames) and ``close()``."""

    cannot_reach: ClassVar[str] = "cannot reach receiver"  # how a failed ``_connect`` is reported, per transport

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        """Starts the worker: a subclass sets up what its worker reads before calling this."""
        super().__init__(config, on_failed)
        self.out = Outbound(self.book, self.backend_name)
        self._stop = threading.Event()
        self._lock = threading.RLock()  # guards _peers
        self._queue: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._peers: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._worker = start_io_thread(self.config.io_cpus, self._work, f"kv-{self.backend_name}-send")
        self.book.start(self.config)

    def _connect(self, endpoint: str) -> Any:
        """A new peer connected to the receiver at ``endpoint``; raises if it cannot be made."""
        raise NotImplementedError

    def _payload(self, w: PeerWrites, layer: int, kv: int, piece: Piece, t: torch.Tensor) -> None:
        """Add ``piece``'s K (``kv=0``) or V bytes of ``layer`` to ``w``, after its DATA header."""
        raise NotImplementedError

    def _gather_layer(self, writes: dict[Any, PeerWrites], request_id: str, layer: int) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        k, v = self.out.kv_caches[layer]
        for leg in entry.ctx.legs:
            w = writes_for(writes, leg.peer, entry.deadline)
            for p in leg.pieces:
                for kv, t in enumerate((k, v)):
                    w.frames.append(Frame(Kind.DATA, leg.dest.transfer_id, layer, kv, p.dst_start, p.num_blocks,
                                          p.dst_heads[0], p.dst_heads[1], p.nbytes).pack())
                    self._payload(w, layer, kv, p, t)
            w.layers.append((entry, leg, 2 * sum(p.nbytes for p in leg.pieces)))

    def _flush(self, writes: dict[Any, PeerWrites]) -> None:
        raise NotImplementedError

    def _idle(self) -> None:
        """Called by the worker before it waits for more items, when none is queued."""

    def close(self) -> None:
        self._stop.set()
        self._queue.put(("stop", None, None))
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            peer.close()  # ends the readers' blocking reads
        join_all([self._worker, *self._threads], self.config.close_timeout_s)
        self.book.stop(self.config.close_timeout_s / 4)

    def start(self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
              deadline_s: float) -> None:
        entry = self.out.open(request_id, dest, src_block_ids, deadline_s)
        for leg in entry.ctx.legs:
            try:
                with self._lock:  # held while connecting: two starts towards one receiver must not both connect
                    peer = self._peers.get(leg.dest.endpoint)
                    if peer is None or not peer.alive:  # a new peer: record it and start its reader thread
                        peer = self._peers[leg.dest.endpoint] = self._connect(leg.dest.endpoint)
                        reader = start_io_thread(self.config.io_cpus, self._read, f"kv-{self.backend_name}-ack-"
                                                 f"{peer.endpoint}", peer)
                        self._threads = [t for t in self._threads if t.is_alive()] + [reader]
            except Exception as e:
                self.book.fail(entry, f"sender: {self.cannot_reach} {leg.dest.endpoint}: {e}".splitlines()[0])
                return
            with self.book.lock:
                peer.legs[leg.dest.transfer_id] = (entry, leg)
                leg.peer = peer
        hello = hello_payload(self.out.plan(entry))  # plan raises CompatibilityError; the peer is told
        for leg in entry.ctx.legs:
            self._submit(("control", leg.peer, control(Kind.HELLO, leg.dest.transfer_id, hello)))

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                self._submit(("control", leg.peer, control(Kind.FAIL, leg.dest.transfer_id, message.encode())))

    def _on_reply(self, peer: Any, frame: Frame, payload: bytes | bytearray) -> None:
        with self.book.lock:  # an ACK ends the leg on this peer
            tid = frame.transfer_id
            found = peer.legs.pop(tid, None) if frame.kind == Kind.ACK else peer.legs.get(tid)
        if found is not None:
            self.out.on_reply(found[0], found[1], frame, payload)

    def _read(self, peer: Any) -> None:
        try:
            while not self._stop.is_set() and peer.alive:
                for frame, payload in peer.replies(self._stop):
                    self._on_reply(peer, frame, payload)
        except InterruptedError:
            return
        except Exception as e:  # EOF (a killed receiver's kernel closes its socket), a broken stream, a bad frame
            if not self._stop.is_set():
                self._drop(peer, f"receiver connection lost (peer closed or killed): {e}")

    def _drop(self, peer: Any, reason: str) -> None:
        """``peer`` is gone: close it (the receiver sees EOF and fails its side at once) and fail every request it
        carried."""
        endpoint = peer.endpoint
        with self._lock:
            peer.alive = False
            if self._peers.get(endpoint) is peer:
                del self._peers[endpoint]
        peer.close()
        with self.book.lock:
            legs = list(peer.legs.values())
            peer.legs.clear()
        for entry, _ in legs:
            self.book.fail(entry, f"sender: {reason} ({peer.endpoint})".splitlines()[0])

    def _submit(self, item: tuple[str, Any, Any]) -> None:
        """Hand one item (control, layer or finish) to the writes: by default queued for the worker."""
        self._queue.put(item)

    def _work(self) -> None:
        """The worker: it waits (up to ``io_timeout_s``) for an item, takes whatever else is already queued (up to
        ``MAX_BATCH``) and sends them in the same writes."""
        while not self._stop.is_set():
            if self._queue.empty():
                self._idle()
            try:
                batch = [self._queue.get(timeout=self.config.io_timeout_s)]
            except queue.Empty:
                continue
            while len(batch) < MAX_BATCH and not self._queue.empty():  # the only consumer: this get cannot fail
                batch.append(self._queue.get_nowait())
            if not self._handle(batch):
                return

    def _handle(self, batch: list[tuple[str, Any, Any]]) -> bool:
        """Gather ``batch``'s items per peer and write them (``_flush``); False when it held the stop item. Items
        are handled by one thread at a time (the worker, or a subclass's caller under its own lock)."""
        writes: dict[Any, PeerWrites] = {}
        try:
            for op, arg, extra in batch:
                if op == "stop":
                    return False
                if op == "control":
                    writes_for(writes, arg, time.monotonic() + self.config.connect_timeout_s).frames.append(extra)
                elif op == "layer":
                    if extra is not None:  # pragma: no cover - needs a GPU
                        extra.synchronize()
                    self._gather_layer(writes, *arg)
                elif op == "finish" and (entry := self.out.live(arg)) is not None:
                    entry.ctx.finish_requested = True
                    for leg in entry.ctx.legs:
                        w = writes_for(writes, leg.peer, entry.deadline)
                        w.frames.append(control(Kind.FINISH, leg.dest.transfer_id))
        except InterruptedError:
            return False
        except Exception:  # never let one request kill the worker
            log.exception("kv %s sender: building writes failed", self.backend_name)
        finally:
            self._flush(writes)
        return True

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.out.register(kv_caches, layout)

    def send_layer(self, request_id: str, layer: int) -> None:
        self.book.get(request_id)  # KeyError for a request that was never started
        ready = None
        if self.out.kv_caches and self.out.kv_caches[layer][0].is_cuda:  # pragma: no cover - needs a GPU
            ready = torch.cuda.Event()
            ready.record()
        self._submit(("layer", (request_id, layer), ready))

    def finish(self, request_id: str) -> None:
        self.book.get(request_id)
        self._submit(("finish", request_id, None))

    def release(self, request_id: str) -> None:
        entry = self.out.release(request_id)
        if entry is not None:
            with self.book.lock:
                for leg in entry.ctx.legs:
                    if leg.peer is not None:
                        leg.peer.legs.pop(leg.dest.transfer_id, None)
