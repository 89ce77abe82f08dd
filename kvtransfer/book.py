"""Per-side request ledger with leases: the transfer states and, per transfer, state, counters and deadline.

One reaper thread per book fails entries past their deadline (sleeping until the earliest one, so an idle book
costs no wake-ups) and delivers every failure outside the lock: to the peer when it was decided here, then to the
owner's ``on_failed``. ``on_done`` is called at once on the thread that saw DONE, so it must only signal.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import start_io_thread

log = logging.getLogger(__name__)
REAPER_IDLE_S = 0.5  # the reaper's longest sleep: a backstop, deadlines and failures wake it themselves
OnFailed = Callable[[str, str], None]
OnDone = Callable[[str], None]


class TransferState(IntEnum):
    """Ordered, so that "finished" is ``state >= DONE``."""

    PENDING = 0
    IN_FLIGHT = 1
    DONE = 2
    FAILED = 3


@dataclass(slots=True, frozen=True)
class TransferStatus:
    state: TransferState
    error: str | None = None
    bytes_sent: int = 0  # sender: bytes handed to the transport; receiver: bytes landed in reserved blocks
    layers_done: int = 0  # sender: layers fully sent; receiver: layers fully landed

    @property
    def finished(self) -> bool:
        return self.state >= TransferState.DONE


@dataclass(slots=True)
class Entry:
    request_id: str
    deadline: float  # monotonic
    ctx: Any = None  # backend-specific state
    state: TransferState = TransferState.PENDING
    error: str | None = None
    nbytes: int = 0
    layers_done: int = 0
    busy: int = 0  # receivers: writes into the reserved blocks in progress (expiry waits for them)
    started: float = field(default_factory=time.monotonic)


class TransferBook:
    def __init__(self, side: str, on_failed: OnFailed | None,
                 notify_peer: Callable[[Entry, str], None] | None = None) -> None:
        self.side = side
        self.lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._on_failed = on_failed
        self._notify_peer = notify_peer
        self.on_done: OnDone | None = None  # set through KVSender/KVReceiver.set_on_done
        self._outbox: collections.deque[tuple[Entry, str, bool, bool]] = collections.deque()
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the reaper: a nearer deadline, a failure to deliver, stop
        self._wake_at = math.inf  # monotonic time the reaper sleeps until; inf while it is awake (looking)
        self._thread: threading.Thread | None = None

    def start(self, config: TransferConfig) -> None:
        """Start the lease reaper: it ticks at most every ``config.poll_interval_s``, on ``config.io_cpus``."""
        self._thread = start_io_thread(config.io_cpus, self._reap, f"kv-{self.side}-leases", config.poll_interval_s)

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._deliver()

    def add(self, request_id: str, deadline_s: float, ctx: Any = None) -> Entry:
        with self.lock:
            if request_id in self._entries:
                raise ValueError(f"{self.side}: request {request_id!r} is already registered (release it first)")
            entry = Entry(request_id, time.monotonic() + (deadline_s - time.time()), ctx)  # to this process's clock
            self._entries[request_id] = entry
        if entry.deadline < self._wake_at:  # due before the reaper's next look (or it is looking now): wake it
            self._kick.set()
        return entry

    def find(self, request_id: str) -> Entry | None:
        with self.lock:
            return self._entries.get(request_id)

    def get(self, request_id: str) -> Entry:
        entry = self.find(request_id)
        if entry is None:
            raise KeyError(f"{self.side}: unknown request {request_id!r}")
        return entry

    def pop(self, request_id: str) -> Entry | None:
        with self.lock:
            return self._entries.pop(request_id, None)

    def entries(self) -> list[Entry]:
        with self.lock:
            return list(self._entries.values())

    def status(self, request_id: str) -> TransferStatus:
        self.expire_due()
        with self.lock:
            entry = self.get(request_id)
            return TransferStatus(entry.state, entry.error, entry.nbytes, entry.layers_done)

    def fail(self, entry: Entry, message: str, notify_peer: bool = False, tell_owner: bool = True) -> bool:
        """Move ``entry`` to FAILED (first failure wins); returns whether it transitioned. ``notify_peer``: decided
        here, so tell the peer; ``tell_owner=False``: the owner caused it (``release``), no ``on_failed``."""
        with self.lock:
            if entry.state >= TransferState.DONE:
                return False
            entry.state = TransferState.FAILED
            entry.error = message
            self._outbox.append((entry, message, notify_peer, tell_owner))
        self._kick.set()
        return True

    def done(self, entry: Entry) -> bool:
        with self.lock:
            if entry.state >= TransferState.DONE:
                return False
            entry.state = TransferState.DONE
        on_done = self.on_done
        if on_done is not None:
            try:
                on_done(entry.request_id)
            except Exception:
                log.exception("%s: on_done callback raised for %s", self.side, entry.request_id)
        return True

    def expire_due(self) -> float | None:
        """Fail every unfinished entry past its deadline; return the earliest deadline still ahead (monotonic),
        or None when no unfinished entry is left. An entry past its deadline with a write in progress (``busy``)
        expires once the write ends, so it counts as due now."""
        now = time.monotonic()
        nearest: float | None = None
        with self.lock:
            for entry in self._entries.values():
                if entry.state >= TransferState.DONE:
                    continue
                if now >= entry.deadline and not entry.busy:
                    self.fail(entry, f"{self.side}: lease expired after {now - entry.started:.2f}s "
                              f"({entry.layers_done} layers, {entry.nbytes} bytes done)", notify_peer=True)
                elif nearest is None or entry.deadline < nearest:
                    nearest = entry.deadline
        return nearest

    def begin_write(self, entry: Entry) -> bool:
        """Receivers, before writing into ``entry``'s blocks: False once it is FAILED (or DONE), so no byte is
        written after that is visible; else the write counts as in progress until ``end_write``."""
        with self.lock:
            if entry.state >= TransferState.DONE:
                return False
            entry.busy += 1
            return True

    def end_write(self, entry: Entry) -> None:
        with self.lock:
            entry.busy -= 1

    def _deliver(self) -> None:
        while True:
            try:
                entry, message, notify, tell_owner = self._outbox.popleft()
            except IndexError:
                return
            if notify and self._notify_peer is not None:
                try:
                    self._notify_peer(entry, message)
                except Exception as e:  # best effort: the peer's own lease is the backstop
                    log.debug("%s: could not tell the peer about %s: %s", self.side, entry.request_id, e)
            if tell_owner and self._on_failed is not None:
                try:
                    self._on_failed(entry.request_id, message)
                except Exception:
                    log.exception("%s: on_failed callback raised for %s", self.side, entry.request_id)

    def _reap(self, interval_s: float) -> None:
        """Until stopped: expire, deliver, then sleep until the earliest deadline (``interval_s`` while an expired
        entry waits for its write to end; ``REAPER_IDLE_S`` at most, as a backstop)."""
        while not self._stop.is_set():
            # Before looking: while _wake_at is inf every add() kicks, so an entry that expire_due misses because
            # it came after the walk still cuts the wait below short (the event stays set).
            self._wake_at = math.inf
            self._kick.clear()
            nearest = self.expire_due()
            self._deliver()
            wait = REAPER_IDLE_S if nearest is None else min(REAPER_IDLE_S, nearest - time.monotonic())
            wait = max(wait, interval_s)
            self._wake_at = time.monotonic() + wait
            self._kick.wait(wait)
