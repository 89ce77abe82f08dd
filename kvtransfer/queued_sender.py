"""The request-side half shared by senders that hand layers to one background worker thread (TCP, torch).

Such a sender keeps its requests in a :class:`TransferBook`, plans them with :class:`Outbound`, and queues
``("control", peer, frame_bytes)``, ``("layer", (request_id, layer), ready_event)`` and ``("finish", request_id,
None)`` items for its worker thread, which takes them in batches (:meth:`QueuedSender._next_batch`); how the bytes
then travel is the subclass's business. A peer is the subclass's connection to one receiver: it has ``legs``
(transfer id → the entry and leg it carries), and what it reads back goes through :meth:`QueuedSender._on_reply`.
``send_layer`` records a CUDA event when the KV lives on a GPU, so the worker thread waits for that layer's kernels,
not for the whole stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch

from kvtransfer.base import DestinationInfo, KVCaches, KVSender, OnFailed, TransferStatus
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout
from kvtransfer.outgoing import Leg, Outbound
from kvtransfer.wire import Frame, Kind, control, hello_payload

MAX_BATCH = 64  # queued items a worker thread takes into one round of writes


class Peer(Protocol):
    legs: dict[int, tuple[Entry, Leg]]


class QueuedSender(KVSender):
    cannot_reach: ClassVar[str] = "cannot reach receiver"  # how a failed ``_peer`` is reported, per transport

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        """The shared state; a subclass then sets up its transport and starts its worker thread and the book."""
        super().__init__(config, on_failed)
        self.book = TransferBook("sender", on_failed, self._notify_peer)
        self.out = Outbound(self.book, self.backend_name)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def _peer(self, endpoint: str) -> Peer:
        """The live connection to the receiver at ``endpoint``, made if needed; raises if it cannot be made."""
        raise NotImplementedError

    def start(
        self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
        deadline_s: float,
    ) -> None:
        entry = self.out.open(request_id, dest, src_block_ids, deadline_s)
        for leg in entry.ctx.legs:
            try:
                peer = self._peer(leg.dest.endpoint)
            except Exception as e:
                self.book.fail(entry, f"sender: {self.cannot_reach} {leg.dest.endpoint}: {e}".splitlines()[0])
                return
            with self.book.lock:
                peer.legs[leg.dest.transfer_id] = (entry, leg)
                leg.peer = peer
        self.out.plan(entry)  # raises CompatibilityError; the peer is told through _notify_peer
        assert self.out.layout is not None
        hello = hello_payload(self.out.layout)
        for leg in entry.ctx.legs:
            self._queue.put(("control", leg.peer, control(Kind.HELLO, leg.dest.transfer_id, hello)))

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                self._queue.put(("control", leg.peer, control(Kind.FAIL, leg.dest.transfer_id, message.encode())))

    def _on_reply(self, peer: Peer, frame: Frame, payload: bytes | bytearray) -> None:
        """A frame the receiver sent back on ``peer``: ACK completes that leg, FAIL fails its request."""
        with self.book.lock:
            found = peer.legs.get(frame.transfer_id)
        if found is None:
            return
        entry, leg = found
        if frame.kind == Kind.ACK:
            self.out.leg_acked(entry, leg)
            with self.book.lock:
                peer.legs.pop(frame.transfer_id, None)
        elif frame.kind == Kind.FAIL:
            self.book.fail(entry, f"sender: receiver reported: {payload.decode(errors='replace')}")

    def _fail_legs(self, peer: Peer, why: str) -> None:
        """``peer`` is gone: fail every request it carried."""
        with self.book.lock:
            legs = list(peer.legs.values())
            peer.legs.clear()
        for entry, _ in legs:
            self.book.fail(entry, why)

    def _next_batch(self) -> list[tuple[str, Any, Any]] | None:
        """The worker thread's next items: one waited for (up to ``io_timeout_s``; None if none came), then
        whatever else is already queued, up to ``MAX_BATCH``, so they go out in the same writes."""
        try:
            batch = [self._queue.get(timeout=self.config.io_timeout_s)]
        except queue.Empty:
            return None
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.out.register(kv_caches, layout)

    def send_layer(self, request_id: str, layer: int) -> None:
        self.book.get(request_id)  # KeyError for a request that was never started
        ready = None
        if self.out.kv_caches and self.out.kv_caches[layer][0].is_cuda:  # pragma: no cover - needs a GPU
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put(("layer", (request_id, layer), ready))

    def finish(self, request_id: str) -> None:
        self.book.get(request_id)
        self._queue.put(("finish", request_id, None))

    def poll(self, request_id: str) -> TransferStatus:
        return self.book.status(request_id)

    def release(self, request_id: str) -> None:
        entry = self.book.find(request_id)
        if entry is None:
            return
        self.book.fail(entry, "sender: released before completion", notify_peer=True, tell_owner=False)
        with self.book.lock:
            for leg in entry.ctx.legs:
                if leg.peer is not None:
                    leg.peer.legs.pop(leg.dest.transfer_id, None)
            self.book.pop(request_id)
