"""torch.distributed sender: joins the receiver's store, ``send``s each queued layer's block runs, completes on ACK.
Design: :mod:`kvtransfer.torch_dist`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore

from kvtransfer.base import DestinationInfo, OnFailed
from kvtransfer.book import Entry
from kvtransfer.config import TransferConfig
from kvtransfer.outgoing import Leg
from kvtransfer.pacing import Backoff
from kvtransfer.queued_sender import QueuedSender
from kvtransfer.torch_group import (
    PAIRS_KEY,
    TAG,
    StoreQueue,
    as_bytes,
    make_group,
    split_frames,
    store_client,
)
from kvtransfer.wire import Frame, Kind, control, hello_payload

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _OutPair:
    endpoint: str
    store: Any
    group: Any
    requests: StoreQueue
    replies: StoreQueue
    legs: dict[int, tuple[Entry, Leg]] = field(default_factory=dict)
    alive: bool = True


class TorchSender(QueuedSender):
    backend_name: ClassVar[str] = "torch"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self._pairs: dict[str, _OutPair] = {}
        self._inflight: list[tuple[Entry, Leg, list[Any], list[torch.Tensor]]] = []
        self._worker = threading.Thread(target=self._work, name="kv-torch-send", daemon=True)
        self._worker.start()
        self.book.start(self.config.poll_interval_s)

    def start(
        self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
        deadline_s: float,
    ) -> None:
        entry = self.out.open(request_id, dest, src_block_ids, deadline_s)
        for leg in entry.ctx.legs:
            try:
                pair = self._pair(leg.dest.endpoint)
            except Exception as e:
                self.book.fail(entry, f"sender: cannot form a group with {leg.dest.endpoint}: {e}".splitlines()[0])
                return
            with self.book.lock:
                pair.legs[leg.dest.transfer_id] = (entry, leg)
                leg.peer = pair
        self.out.plan(entry)  # raises CompatibilityError after telling the receiver(s)
        assert self.out.layout is not None
        hello = hello_payload(self.out.layout)
        for leg in entry.ctx.legs:
            self._queue.put(("control", leg.peer, control(Kind.HELLO, leg.dest.transfer_id, hello)))

    def close(self) -> None:
        self._stop.set()
        self._queue.put(("stop", None, None))
        end = time.monotonic() + self.config.close_timeout_s
        for t in [self._worker, *self._threads]:
            t.join(max(0.0, end - time.monotonic()))
        self.book.stop(max(0.05, end - time.monotonic()))

    # ---- pairs
    def _pair(self, endpoint: str) -> _OutPair:
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is not None and pair.alive:
                return pair
            cfg = self.config
            store = store_client(endpoint, cfg.connect_timeout_s)
            index = int(store.add(PAIRS_KEY, 1)) - 1
            name = f"tandem/pair/{index}"
            queues = PrefixStore(name, store)
            cuda = bool(self.out.kv_caches) and self.out.kv_caches[0][0].is_cuda
            group = make_group(PrefixStore(name, store_client(endpoint, cfg.connect_timeout_s)), 1, cuda,
                               cfg.connect_timeout_s)
            # Requests and replies on separate clients too: the reply reader polls while the worker writes.
            replies = PrefixStore(name, store_client(endpoint, cfg.connect_timeout_s))
            pair = _OutPair(endpoint, store, group, StoreQueue(queues, "s2r"), StoreQueue(replies, "r2s"))
            self._pairs[endpoint] = pair
        t = threading.Thread(target=self._read, args=(pair,), name=f"kv-torch-ack-{endpoint}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return pair

    def _drop(self, pair: _OutPair, reason: str) -> None:
        with self._lock:
            pair.alive = False
            if self._pairs.get(pair.endpoint) is pair:
                del self._pairs[pair.endpoint]
        with self.book.lock:
            legs = list(pair.legs.values())
            pair.legs.clear()
        for entry, _ in legs:
            self.book.fail(entry, f"sender: {reason} ({pair.endpoint})")

    def _read(self, pair: _OutPair) -> None:
        idle = Backoff(self.config.poll_interval_s)
        busy = Backoff(2e-4, min_s=1e-4)  # an ACK is due: keep its latency low while requests are in flight
        try:
            while not self._stop.is_set() and pair.alive:
                waiting = bool(pair.legs)
                blob = pair.replies.get(0.01 if waiting else self.config.io_timeout_s, busy if waiting else idle,
                                        self._stop)
                if blob is None:
                    continue
                for frame, payload in split_frames(blob):
                    with self.book.lock:
                        found = pair.legs.get(frame.transfer_id)
                    if found is None:
                        continue
                    entry, leg = found
                    if frame.kind == Kind.ACK:
                        self.out.leg_acked(entry, leg)
                        with self.book.lock:
                            pair.legs.pop(frame.transfer_id, None)
                    elif frame.kind == Kind.FAIL:
                        self.book.fail(entry, f"sender: receiver reported: {payload.decode(errors='replace')}")
        except Exception as e:
            self._drop(pair, f"receiver connection lost (peer closed or killed): {e}".splitlines()[0])

    # ---- worker: the only thread that talks to groups
    def _work(self) -> None:
        while not self._stop.is_set():
            if self._queue.empty():
                self._complete()  # nothing queued behind: wait for the layers in flight
            try:
                op, arg, extra = self._queue.get(timeout=self.config.io_timeout_s)
            except queue.Empty:
                continue
            if op == "stop":
                return
            if op != "layer":
                self._complete()  # control frames follow the payloads they come after
            try:
                if op == "control":
                    if arg.alive:
                        arg.requests.put(extra)
                elif op == "layer":
                    if extra is not None:  # pragma: no cover - needs a GPU
                        extra.synchronize()
                    self._send_layer(*arg)
                elif op == "finish":
                    entry = self.out.live(arg)
                    if entry is not None:
                        entry.ctx.finish_requested = True
                        for leg in entry.ctx.legs:
                            leg.peer.requests.put(control(Kind.FINISH, leg.dest.transfer_id))
            except Exception as e:
                log.debug("kv torch sender: %s failed: %s", op, e)
                if op == "control":
                    self._drop(arg, f"receiver connection lost: {e}".splitlines()[0])

    def _send_layer(self, request_id: str, layer: int) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        k, v = self.out.kv_caches[layer]
        for leg in entry.ctx.legs:
            pair: _OutPair = leg.peer
            if not pair.alive:
                return
            headers, payloads = [], []
            for p in leg.pieces:
                for kv, t in enumerate((k, v)):
                    headers.append(Frame(Kind.DATA, leg.dest.transfer_id, layer, kv, p.dst_start, p.num_blocks,
                                         p.dst_heads[0], p.dst_heads[1], p.nbytes).pack())
                    src = p.src_view(t)
                    payloads.append(as_bytes(src if src.is_contiguous() else src.contiguous()))
            try:
                pair.requests.put(b"".join(headers))
                works = [pair.group.send([buf], 0, TAG) for buf in payloads]  # the receiver is rank 0
            except Exception as e:
                self._drop(pair, f"receiver connection lost (peer closed or killed): {e}".splitlines()[0])
                return
            # Completed later (_complete), so the next layer's header and sends overlap these payloads.
            self._inflight.append((entry, leg, works, payloads))

    def _complete(self) -> None:
        while self._inflight:
            entry, leg, works, _payloads = self._inflight.pop(0)
            try:
                for w in works:
                    w.wait()
            except Exception as e:
                self._drop(leg.peer, f"receiver connection lost (peer closed or killed): {e}".splitlines()[0])
                continue
            self.out.leg_sent_layer(entry, leg, sum(p.nbytes for p in leg.pieces) * 2)

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                self._queue.put(("control", leg.peer, control(Kind.FAIL, leg.dest.transfer_id, message.encode())))
