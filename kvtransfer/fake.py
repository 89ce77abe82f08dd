"""In-process fake backend for unit tests: the sender copies straight into the receiver's blocks through the same
landing checks and leases as the real backends; :class:`FakeBehaviour` injects a loud failure or a silent stall.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtransfer.base import DestinationInfo, KVCaches, KVSender, OnFailed
from kvtransfer.book import Entry
from kvtransfer.config import TransferConfig
from kvtransfer.landing import LandingReceiver
from kvtransfer.layout import KVLayout
from kvtransfer.outgoing import Leg, Outbound
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, hello_payload, unpack

_RECEIVERS: weakref.WeakValueDictionary[str, FakeReceiver] = weakref.WeakValueDictionary()
_NEXT = itertools.count()
_TABLE_LOCK = threading.Lock()


@dataclass(slots=True, frozen=True)
class FakeBehaviour:
    fail_at_layer: int | None = None  # send_layer(this layer) fails loudly; the receiver is told
    stall_from_layer: int | None = None  # layers from this one on are dropped silently; leases must catch it
    message: str = "fake: injected sender failure"

    def __post_init__(self) -> None:
        for name in ("fail_at_layer", "stall_from_layer"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"FakeBehaviour.{name} must be >= 0")


class FakeReceiver(LandingReceiver):
    backend_name: ClassVar[str] = "fake"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        with _TABLE_LOCK:
            self.endpoint = f"fake://{next(_NEXT)}"
            _RECEIVERS[self.endpoint] = self
        self.book.start(self.config)

    def close(self) -> None:
        self.book.stop(self.config.close_timeout_s)
        with _TABLE_LOCK:
            _RECEIVERS.pop(self.endpoint, None)

    # ---- called by FakeSender
    def deliver(self, frame: Frame, src: object, sender: tuple[FakeSender, Entry, Leg]) -> None:
        entry = self._live(frame.transfer_id)
        if entry is None:
            return
        if frame.kind != Kind.DATA:  # HELLO, FINISH, FAIL: their payloads as bytes, as on a wire
            self._control(entry, frame, src, sender)  # type: ignore[arg-type]
            return
        if self._admit(entry, frame):
            self._view(frame).copy_(src)  # type: ignore[arg-type]
            self._landed(entry, frame)

    def _send(self, peer: tuple[FakeSender, Entry, Leg], data: bytes) -> None:
        peer[0].out.on_reply(peer[1], peer[2], unpack(data), data[HEADER_SIZE:])


class FakeSender(KVSender):
    backend_name: ClassVar[str] = "fake"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None,
                 behaviour: FakeBehaviour | None = None) -> None:
        super().__init__(config, on_failed)
        self.behaviour = behaviour or FakeBehaviour()
        self.out = Outbound(self.book, self.backend_name)
        self.book.start(self.config)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.out.register(kv_caches, layout)

    def start(self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
              deadline_s: float) -> None:
        entry = self.out.open(request_id, dest, src_block_ids, deadline_s)
        for leg in entry.ctx.legs:
            leg.peer = _RECEIVERS.get(leg.dest.endpoint)
            if leg.peer is None:
                self.book.fail(entry, f"sender: no fake receiver at {leg.dest.endpoint}")
                return
        hello = hello_payload(self.out.plan(entry))
        for leg in entry.ctx.legs:
            leg.peer.deliver(Frame(Kind.HELLO, leg.dest.transfer_id), hello, (self, entry, leg))

    def send_layer(self, request_id: str, layer: int) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        b = self.behaviour
        if b.fail_at_layer is not None and layer >= b.fail_at_layer:
            self.book.fail(entry, b.message, notify_peer=True)
            return
        if b.stall_from_layer is not None and layer >= b.stall_from_layer:
            return
        k, v = self.out.kv_caches[layer]
        for leg in entry.ctx.legs:
            for p in leg.pieces:
                for kv, t in enumerate((k, v)):
                    frame = Frame(Kind.DATA, leg.dest.transfer_id, layer, kv, p.dst_start, p.num_blocks,
                                  p.dst_heads[0], p.dst_heads[1], p.nbytes)
                    leg.peer.deliver(frame, p.src_view(t), (self, entry, leg))
            self.out.leg_sent_layer(entry, leg, 2 * sum(p.nbytes for p in leg.pieces))

    def finish(self, request_id: str) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        entry.ctx.finish_requested = True
        if self.behaviour.stall_from_layer is not None:
            return
        for leg in entry.ctx.legs:
            leg.peer.deliver(Frame(Kind.FINISH, leg.dest.transfer_id), b"", (self, entry, leg))

    def release(self, request_id: str) -> None:
        self.out.release(request_id)

    def close(self) -> None:
        self.book.stop(self.config.close_timeout_s)

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                leg.peer.deliver(Frame(Kind.FAIL, leg.dest.transfer_id), message.encode(), (self, entry, leg))
