"""NIXL receiver: registers the KV tensors, publishes them in the hand-off, and counts landed layers from the
senders' notifications. Design: :mod:`kvtransfer.nixl_backend`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtransfer.base import DestinationInfo, KVCaches, KVReceiver, OnFailed, TransferStatus
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.doorbell import Doorbell
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.landing import Landing
from kvtransfer.layout import KVLayout
from kvtransfer.nixl_agent import handed_after, make_agent, mem_of, parse_hello
from kvtransfer.pacing import Backoff
from kvtransfer.wire import HEADER_SIZE, Kind, control, unpack

log = logging.getLogger(__name__)
ACTIVE_POLL_S = 2.5e-4
IDLE_POLL_S = 0.5
HELLO_WINDOW_S = 0.002
MAX_SLEEP_S = 0.02  # the longest sleep while some reservation has layers due
# Where the last layer may land, around its predicted time, in layer times: polled every ACTIVE_POLL_S. Measured
# on 2 vCPUs, one prefill's layer times spread +-30% around their mean (other processes, memory bandwidth).
DUE_EARLY, DUE_LATE = 0.3, 0.6


@dataclass(slots=True)
class _Pace:
    """What the watcher knows of one transfer's timing, for predicting when its last layer lands.

    Each DATA notification says when the sender was handed that layer, i.e. when its compute ended, as an offset
    from the leg's HELLO on the sender's clock (:func:`kvtransfer.nixl_agent.data_notif`). Two of them give the
    prefill's layer time, so the last layer is due ``offset(last) = offset(j) + (last - j) * layer_time`` after
    the HELLO. The HELLO arrived after the poll before the one that saw it (and after the reservation was made):
    ``hello_lo``, so ``hello_lo + offset(last)`` is an early estimate of the last layer's arrival, which also
    carries its copy and notification. Offsets, not arrival times: the progress thread that posts the earlier
    layers may post them late (it waits for the forward pass to release the GIL), while the last layer is posted
    by the forward thread itself, so arrival times would predict the end too late.
    """

    hello_lo: float
    hello_seen: float
    first: tuple[int, float] | None = None  # (layer, offset) of the lowest layer reported
    last: tuple[int, float] | None = None  # (layer, offset) of the highest
    landed_at: float = 0.0  # the watcher's poll time when a layer of this transfer last landed

    def note(self, layer: int, offset: float, now: float) -> None:
        self.landed_at = now
        if self.first is None or layer < self.first[0]:
            self.first = (layer, offset)
        if self.last is None or layer > self.last[0]:
            self.last = (layer, offset)

    def due(self, layers: int) -> tuple[float, float] | None:
        """(when the last layer is due, monotonic; the mean layer time), once two layers were reported."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        lt = max(self.last[1] - self.first[1], 0.0) / (self.last[0] - self.first[0])
        return self.hello_lo + self.last[1] + (layers - 1 - self.last[0]) * lt, lt


class NixlReceiver(KVReceiver):
    backend_name: ClassVar[str] = "nixl"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self.book = TransferBook("receiver", on_failed, self._notify_peer)
        self.landing = Landing(self.book, self.backend_name)
        self._agent = make_agent(self.config, "decode")
        self._agent_lock = threading.Lock()
        self._bell = Doorbell(self.config.host)  # the senders ring it when a transfer's last layer is written
        self._metadata = b""
        self._regions: tuple[tuple[int, int], ...] = ()
        self._reg: Any = None
        self._known: set[str] = set()
        self._stop = threading.Event()
        self._reserved = threading.Event()  # set by reserve: the watcher starts polling
        self._pace: dict[int, _Pace] = {}  # transfer id -> timing, from its HELLO on (watcher thread only)
        self._poll_prev = self._poll_now = 0.0  # the watcher's previous and current poll times
        self._thread = start_io_thread(self.config.io_cpus, self._watch, "kv-nixl-notifs")
        self.book.start(self.config)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)
        tensors = [t for pair in kv_caches for t in pair]
        with self._agent_lock:
            self._reg = self._agent.register_memory(tensors)
            self._metadata = self._agent.get_agent_metadata()
        self._regions = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        self._mem = mem_of(tensors[0])

    def reserve(
        self, request_id: str, dst_block_ids: Sequence[int], num_tokens: int, deadline_s: float
    ) -> DestinationInfo:
        dest = self.landing.reserve(
            request_id, dst_block_ids, num_tokens, deadline_s, endpoint=self._bell.endpoint,
            agent_name=self._agent.name, agent_metadata=self._metadata, regions=self._regions,
            mem_type=self._mem[0], device_id=self._mem[1],
        )
        self._reserved.set()
        return dest

    def poll(self, request_id: str) -> TransferStatus:
        return self.book.status(request_id)

    def release(self, request_id: str) -> None:
        entry = self.book.find(request_id)
        if entry is not None:
            self.book.fail(entry, "receiver: released before completion", notify_peer=True, tell_owner=False)
            self.landing.forget(request_id)

    def close(self) -> None:
        self._stop.set()
        self._reserved.set()
        self._thread.join(self.config.close_timeout_s * 0.6)
        self.book.stop(self.config.close_timeout_s * 0.2)
        self._bell.close()
        with self._agent_lock:
            if self._reg is not None:
                try:
                    self._agent.deregister_memory(self._reg)
                except Exception as e:
                    log.debug("nixl receiver: deregister failed: %s", e)
                self._reg = None

    def _send(self, agent_name: str, msg: bytes) -> None:
        with self._agent_lock:
            self._agent.send_notif(agent_name, msg)

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for peer in list(entry.ctx.peers):
            self._send(peer, control(Kind.FAIL, entry.ctx.transfer_id, message.encode()))

    def _watch(self) -> None:
        """Poll the agent's notifications, as rarely as the critical path allows: every wake-up is taken from the
        decode loop's CPU and GIL (this thread was the receiver's largest cost per transfer, from waking every
        50 us - 2 ms whether or not anything was due). Only a transfer's *last* DATA notification is on the
        critical path (it lets decode start); earlier layers land while prefill computes later ones.

        - No reservation: no polling; ``reserve`` wakes the thread (``IDLE_POLL_S`` as a backstop, which also
          drains stray notifications of finished transfers).
        - A reservation without its HELLO: every ``poll_interval_s``.
        - For ``HELLO_WINDOW_S`` after a HELLO (until two layers have landed) the tick starts at 50 us and doubles
          up to ``ACTIVE_POLL_S``: a short prompt's layers all land within about a millisecond of its HELLO.
        - Then, per transfer (the nearest wins): half the time left until its predicted last layer (see
          :class:`_Pace`) less ``DUE_EARLY`` layer times, between ``ACTIVE_POLL_S`` and ``MAX_SLEEP_S``; from
          there to ``DUE_LATE`` layer times past the prediction, ``ACTIVE_POLL_S``. So a long prefill is polled
          every tick only around its last layer, not for its whole length, and that layer is still seen within
          ``ACTIVE_POLL_S``. Before two layers are reported, the sleep doubles from ``poll_interval_s``
          (``ACTIVE_POLL_S`` if only the last is missing). Past the window: ``ACTIVE_POLL_S`` while layers keep
          landing (the compute is done and the copies trail it, as when a short prompt's layers all come at
          once), else ``poll_interval_s`` (a stalled sender; its lease bounds the wait).

        Every sleep is a ``select`` on the doorbell, which a sender rings when a leg's last layer is written: the
        schedule above bounds how late a transfer is seen when no ring arrives (before, a 1 MiB request that
        landed in ~0.8 ms waited for the 2 ms tick; an 8 MiB one for its predicted window).
        """
        pace = Backoff(self.config.poll_interval_s)
        while not self._stop.is_set():
            if not self.landing.has_reservations():  # a reserve racing this check sets _reserved: no lost wake-up
                self._reserved.wait(IDLE_POLL_S)
                self._reserved.clear()
            # Not an Event wait: on this VM a 2 ms Event.wait costs ~100 us of CPU against ~55 us for a plain sleep
            # or a select. Only a sender's doorbell (its last layer is written) or close() (bounded by
            # MAX_SLEEP_S) needs to cut the sleep short.
            self._bell.wait(self._next_sleep(time.monotonic(), pace))
            if self._stop.is_set():
                return
            self._poll_prev, self._poll_now = self._poll_now, time.monotonic()
            try:
                with self._agent_lock:
                    notifs = self._agent.get_new_notifs()
            except Exception:
                log.exception("nixl receiver: get_new_notifs failed")
                continue
            for remote, msgs in notifs.items():
                for msg in msgs:
                    try:
                        if self._handle(remote, bytes(msg)) == Kind.HELLO:
                            pace.reset()
                    except Exception:
                        log.exception("nixl receiver: bad notification from %s", remote)
            if self._pace:
                self._forget_finished()

    def _forget_finished(self) -> None:
        for tid in [tid for tid in self._pace if self.landing.live(tid) is None]:
            del self._pace[tid]

    def _next_sleep(self, now: float, pace: Backoff) -> float:
        """This tick's sleep, by the rules of :meth:`_watch`."""
        tick = self.config.poll_interval_s
        best = MAX_SLEEP_S
        window = False
        layout = self.landing.layout
        layers = layout.num_layers if layout is not None else 1
        for entry in self.landing.in_flight():  # a snapshot, taken under the book's lock
            p = self._pace.get(entry.ctx.transfer_id)
            if p is None:  # no HELLO yet
                best = min(best, tick)
                continue
            timing = p.due(layers)
            if timing is None and now < p.hello_seen + HELLO_WINDOW_S:
                window = True
                continue
            if timing is None:
                missing = layers - entry.layers_done
                cand = ACTIVE_POLL_S if missing <= 1 else max((now - p.hello_lo) / 2, tick)
            else:
                due, lt = timing
                opens = due - DUE_EARLY * lt
                if now < opens:
                    cand = max((opens - now) / 2, ACTIVE_POLL_S)
                elif now <= due + DUE_LATE * lt or now - p.landed_at < max(lt, HELLO_WINDOW_S):
                    cand = ACTIVE_POLL_S  # the last layer's window, or the copies still land (compute done)
                else:
                    cand = tick  # later than any prediction and nothing landing: a stalled or slow sender
            best = min(best, cand)
        if window:
            return min(pace.next_timeout(ACTIVE_POLL_S), best)
        return best

    def _handle(self, remote: str, msg: bytes) -> Kind | None:
        """Act on one notification; returns its kind, or None when it was for no live reservation."""
        frame = unpack(msg)
        payload = msg[HEADER_SIZE : HEADER_SIZE + frame.payload_len] if frame.kind != Kind.DATA else b""
        entry = self.landing.live(frame.transfer_id)
        if entry is None:
            return None
        if frame.kind == Kind.HELLO:
            try:
                layout, name, metadata = parse_hello(payload)
                if name not in self._known:
                    with self._agent_lock:
                        self._agent.add_remote_agent(metadata)
                    self._known.add(name)
                self.landing.on_hello(entry, layout, name)
                if frame.transfer_id not in self._pace:  # the first sender's HELLO starts the clock
                    self._pace[frame.transfer_id] = _Pace(max(self._poll_prev, entry.started), self._poll_now)
            except ValueError as e:
                with self.book.lock:
                    if remote in self._known and remote not in entry.ctx.peers:
                        entry.ctx.peers.append(remote)
                self.book.fail(entry, f"receiver: {e}", notify_peer=True)
        elif frame.kind == Kind.DATA:  # NIXL delivers this after the layer's WRITE completed
            pace, offset = self._pace.get(frame.transfer_id), handed_after(msg)
            if pace is not None and offset is not None:
                pace.note(frame.layer, offset, self._poll_now)
            if self.landing.landed(entry, frame.layer, frame.payload_len):
                for peer in list(entry.ctx.peers):
                    self._send(peer, control(Kind.ACK, frame.transfer_id))
        elif frame.kind == Kind.FINISH:
            self.landing.on_finish(entry)
        elif frame.kind == Kind.FAIL:
            self.book.fail(entry, f"receiver: sender reported: {payload.decode(errors='replace')}")
        return frame.kind
