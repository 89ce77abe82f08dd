"""The request-side half shared by senders that hand layers to one background worker thread (TCP, torch).

Such a sender keeps its requests in a :class:`TransferBook`, plans them with :class:`Outbound`, and queues
``("layer", (request_id, layer), ready_event)`` and ``("finish", request_id, None)`` items for its worker thread;
how the bytes then travel is the subclass's business. ``send_layer`` records a CUDA event when the KV lives on a GPU,
so the worker thread waits for that layer's kernels, not for the whole stream.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from kvtransfer.base import KVCaches, KVSender, OnFailed, TransferStatus
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout
from kvtransfer.outgoing import Outbound


class QueuedSender(KVSender):
    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        """The shared state; a subclass then sets up its transport and starts its worker thread and the book."""
        super().__init__(config, on_failed)
        self.book = TransferBook("sender", on_failed, self._notify_peer)
        self.out = Outbound(self.book, self.backend_name)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def _notify_peer(self, entry: Entry, message: str) -> None:
        raise NotImplementedError

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
