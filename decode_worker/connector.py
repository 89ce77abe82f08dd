"""Decode role: the engine's KV connector that lands each prompt's KV from its prefill worker. Lifecycle, as queues::

    Prealloc ──► Transfer ──► Waiting ──► Running ──► finished
    (Reserve:    (KV landing   (KV landed,   (continuous batching
     blocks       layer by      waiting for   with every other
     reserved)    layer)        first token)  request)

- **Prealloc** (:class:`Prealloc`): ``Reserve`` announces the request here, then adds it to the engine; the engine
  asks ``num_remote_tokens``, reserves blocks for the whole prompt (``WAITING_FOR_REMOTE_KV``) and calls
  ``start_load_kv``, which opens a receive lease on them. The reply carries the destination and our compatibility
  hash. No blocks → RESOURCE_EXHAUSTED, so the caller can pick another decode worker before any prefill work.
- **Transfer** (:class:`Transfer`): the receiver reports progress; prefill death, lease expiry or a refused handshake
  become an explicit failure with a message (``get_finished``), which ends the request in the engine, frees its
  blocks and reaches the caller's stream.
- **Waiting** (:class:`Waiting`): decode can start only when both the last layer has landed and ``Decode`` has
  delivered the first token (sampled by prefill). Whichever comes second makes the request loaded; the engine
  accepts the token and moves it to Running. A request whose first token does not arrive within its lease fails.
- **Running**: an ordinary engine request; the next token is computed from the received KV.
- **Held** (:class:`Held`): a request whose reservation ended before its KV landed (aborted, failed, expired)
  while a sender may still write into its blocks: a NIXL WRITE posted on its own (``receiver.release`` returned
  True), or, with TP ranks, a follower that has not answered the release yet. ``request_finished`` keeps its blocks
  held until the receiver lists it in ``quiet()`` and every follower answered; then ``get_finished`` reports it in
  ``sent`` and the engine frees them. A single-rank tcp or torch decode lands every byte on the receiver's threads
  and holds nothing.

A replica with TP ranks (``decode_worker/ranks.py``) reserves on every rank, answers one destination per rank, and
counts a request landed only once every rank landed its heads; a failure on any rank fails it, released everywhere.

While the only requests wait for KV the engine has nothing to compute, and a loop stepping empty schedules back to
back would take a core and the GIL from the transport threads that land the bytes. ``remote_wait_s`` lets the
engine loop sleep instead: every RPC is a command that wakes it, and so is a finished transfer (the receiver's
``on_done`` wakes it), so only a failure or an expired lease waits for that backstop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.ranks import DecodeRanks
from engine.kv_connector import EngineKV, FinishedTransfers, KVConnector, LoadDone, LoadFailed
from engine.request import Request, TokenLogprobs
from kvtransfer.base import DestinationInfo, KVReceiver, TransferState
from kvtransfer.layout import KVLayout

log = logging.getLogger(__name__)
REMOTE_ONLY_WAIT_S = 0.05  # the engine loop's backstop while only transfers are pending: how late a failure is seen
# A held request's blocks are freed this long after its lease deadline at the latest, whatever is unanswered (the
# receiver's own hold ends 1 s after it; only a follower rank that never answers its release waits this out).
HOLD_LIMIT_S = 10.0
FAILED_MEMORY = 1024  # why recent requests failed, kept for a Decode call that arrives after the failure


@dataclass(slots=True)
class Landing:
    """A reserved request: its lease, its destination and, once ``Decode`` delivered it, its first token."""

    deadline_s: float
    dest: DestinationInfo
    num_blocks: int
    more: tuple[DestinationInfo, ...] = ()  # the follower decode ranks' destinations (rank 1 first)
    first_token: int | None = None
    first_logprob: TokenLogprobs | None = None
    reserved_at: float = 0.0  # time.monotonic() when the blocks were reserved (the landing wait's start)


class Prealloc:
    """Requests announced by ``Reserve`` whose blocks the engine is about to reserve: their lease deadlines."""

    def __init__(self) -> None:
        self.deadlines: dict[str, float] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.deadlines


class Transfer:
    """Requests whose KV is landing."""

    def __init__(self) -> None:
        self.entries: dict[str, Landing] = {}

    def poll(self, receiver: KVReceiver, now: float,
             ranks: DecodeRanks | None = None) -> tuple[list[str], list[LoadFailed]]:
        """Requests whose KV landed (on every rank), and those whose transfer failed (on any rank) or outlived its
        lease."""
        landed, failed = [], []
        for rid, entry in self.entries.items():
            st = receiver.poll(rid)
            everywhere, failure = (True, None) if ranks is None else ranks.state(rid)
            if failure is not None:
                failed.append(LoadFailed(rid, f"KV transfer failed: {failure}"))
            elif st.state == TransferState.DONE and everywhere:
                landed.append(rid)
            elif st.state == TransferState.FAILED:
                failed.append(LoadFailed(rid, f"KV transfer failed: {st.error}"))
            elif now > entry.deadline_s + 1.0:
                failed.append(LoadFailed(rid, "KV transfer lease expired"))
        return landed, failed


class Waiting:
    """Requests whose KV landed, until their first token is here."""

    def __init__(self) -> None:
        self.entries: dict[str, Landing] = {}

    def poll(self, now: float) -> tuple[list[LoadDone], list[LoadFailed]]:
        """Requests ready to run, and those whose first token did not come within the lease."""
        ready, failed = [], []
        for rid, entry in self.entries.items():
            if entry.first_token is not None:
                ready.append(LoadDone(rid, entry.first_token, entry.first_logprob))
            elif now > entry.deadline_s:
                failed.append(LoadFailed(rid, "no Decode call arrived within the lease"))
        return ready, failed


class Held:
    """Requests released before their KV landed whose blocks a sender may still write into."""

    def __init__(self) -> None:
        self.until: dict[str, float] = {}  # request -> wall-clock time its hold ends at the latest
        self.receiver: set[str] = set()  # waiting for this rank's receiver to list them quiet
        self.blocks: set[str] = set()  # the engine holds their blocks (request_finished returned True)

    def __len__(self) -> int:
        return len(self.until)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.until

    def add(self, request_id: str, receiver: bool, until: float) -> None:
        self.until[request_id] = until
        if receiver:
            self.receiver.add(request_id)

    def settle(self, quiet: list[str], followers_done: Callable[[str], bool], now: float) -> list[str]:
        """Note the receiver's newly quiet requests; return the held ones whose blocks the engine may free now."""
        self.receiver.difference_update(quiet)
        free = []
        for rid in sorted(self.blocks):
            if now > self.until[rid]:
                log.warning("request %s: blocks freed %.0f s past its lease with a release unanswered", rid,
                            HOLD_LIMIT_S)
            elif rid in self.receiver or not followers_done(rid):
                continue
            free.append(rid)
            self.blocks.discard(rid)
            self.receiver.discard(rid)
            del self.until[rid]
        for rid in [rid for rid, t in self.until.items() if now > t and rid not in self.blocks]:
            self.receiver.discard(rid)  # the engine never finished it here: nothing to free
            del self.until[rid]
        return free


class DecodeConnector(KVConnector):
    remote_wait_s = REMOTE_ONLY_WAIT_S

    def __init__(self, receiver: KVReceiver, layout: KVLayout, wake: Callable[[], object],
                 ranks: DecodeRanks | None = None) -> None:
        self.receiver = receiver
        self.ranks = ranks  # a replica with TP ranks: their receives (decode_worker/ranks.py)
        self.layout = layout
        self.prealloc = Prealloc()
        self.transfer = Transfer()
        self.waiting = Waiting()
        self.held = Held()
        self.failed: OrderedDict[str, str] = OrderedDict()
        self._wake = wake
        self.on_landed: list[Callable[[str, bool], object]] = []  # (request, landed or failed): traces
        # (landed or failed, seconds since its blocks were reserved): worker/metrics.py's landing histogram
        self.on_landing: list[Callable[[bool, float], object]] = []
        receiver.set_on_done(self._on_done)

    def _on_done(self, _request_id: str) -> None:
        self._wake()  # receiver thread: only signal; the engine loop's next step polls the transfer

    # ---- the role's calls (loop thread) ----------------------------------------------------------------------

    def expect(self, request_id: str, deadline_s: float) -> None:
        """``request_id``'s prompt KV will come from a prefill worker, within its lease (Prealloc)."""
        self.prealloc.deadlines[request_id] = deadline_s

    def forget(self, request_id: str) -> None:
        """Leave Prealloc: the engine reserved the blocks (the request is in Transfer) or refused the request."""
        self.prealloc.deadlines.pop(request_id, None)

    def destination(self, request_id: str) -> tuple[DestinationInfo, int] | None:
        """Where prefill writes ``request_id``'s KV on rank 0, and how many blocks (None unless it is in Transfer)."""
        entry = self.transfer.entries.get(request_id)
        return None if entry is None else (entry.dest, entry.num_blocks)

    def destinations(self, request_id: str) -> tuple[DestinationInfo, ...]:
        """Every decode rank's destination for ``request_id``, rank 0 first (empty unless it is in Transfer)."""
        entry = self.transfer.entries.get(request_id)
        return () if entry is None else (entry.dest, *entry.more)

    def deliver(self, request_id: str, first_token: int, first_logprob: TokenLogprobs | None) -> str | None:
        """``Decode`` brought the first token; None, or why there is nothing to decode."""
        entry = self.transfer.entries.get(request_id) or self.waiting.entries.get(request_id)
        if entry is None or entry.first_token is not None:  # a second Decode for one reservation too
            return self.failed.get(request_id, "no reservation here (expired, aborted or never reserved)")
        entry.first_token, entry.first_logprob = first_token, first_logprob
        return None

    def in_transfer(self) -> int:
        """Requests whose KV is landing, or (with ranks) whose reservation a follower still holds."""
        return max(len(self.transfer.entries), self.ranks.outstanding() if self.ranks is not None else 0)

    def _release(self, request_id: str, deadline_s: float, landed: bool = False) -> None:
        """Release ``request_id`` on every rank; unless it ``landed`` everywhere, hold its blocks while a sender may
        still write into them (:class:`Held`)."""
        receiver_hold = self.receiver.release(request_id)
        followers = False
        if self.ranks is not None:
            self.ranks.release(request_id)
            followers = bool(self.ranks.ranks)
        if not landed and (receiver_hold or followers):
            self.held.add(request_id, receiver_hold, deadline_s + HOLD_LIMIT_S)

    # ---- scheduler side ------------------------------------------------------------------------------------

    def num_remote_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if request.request_id in self.prealloc else 0

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        if (entry := self.transfer.entries.pop(rid, None)) is not None:
            self._release(rid, entry.deadline_s)
        self.waiting.entries.pop(rid, None)
        if rid in self.held:  # freed by get_finished once nothing can write into its blocks
            self.held.blocks.add(rid)
            return True
        return False

    def has_pending(self) -> bool:
        return bool(self.transfer.entries or self.waiting.entries or self.held.blocks)

    # ---- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv: EngineKV) -> None:
        self.receiver.register(list(kv.kv_caches), self.layout)

    def start_load_kv(self, request: Request, block_ids: list[int]) -> None:
        rid = request.request_id
        deadline = self.prealloc.deadlines.pop(rid)
        dest = self.receiver.reserve(rid, block_ids, request.num_prompt_tokens, deadline)
        more: tuple[DestinationInfo, ...] = ()
        if self.ranks is not None:
            try:
                more = tuple(self.ranks.reserve(rid, block_ids, request.num_prompt_tokens, deadline))
            except Exception:  # refuses the request: its blocks are freed, no rank keeps a reservation
                self.receiver.release(rid)
                raise
        self.transfer.entries[rid] = Landing(deadline, dest, len(block_ids), more, reserved_at=time.monotonic())

    def get_finished(self) -> FinishedTransfers:
        done = FinishedTransfers()
        if self.held:
            ranks = self.ranks
            done.sent = self.held.settle(self.receiver.quiet(), (lambda _: True) if ranks is None else ranks.released,
                                         time.time())
        if not self.transfer.entries and not self.waiting.entries:
            return done
        now = time.time()
        landed, failed = self.transfer.poll(self.receiver, now, self.ranks)
        if self.on_landing:
            waited = time.monotonic()
            for ok, rids in ((True, landed), (False, [f.request_id for f in failed])):
                for rid in rids:
                    for landing_hook in self.on_landing:
                        landing_hook(ok, waited - self.transfer.entries[rid].reserved_at)
        for rid in landed:
            entry = self.waiting.entries[rid] = self.transfer.entries.pop(rid)
            self._release(rid, entry.deadline_s, landed=True)
        for hook in self.on_landed:
            for rid in landed:
                hook(rid, True)
            for f in failed:
                hook(f.request_id, False)
        done.loaded, failed_waiting = self.waiting.poll(now)
        for loaded in done.loaded:
            del self.waiting.entries[loaded.request_id]
        for f in failed + failed_waiting:
            log.info("request %s failed: %s", f.request_id, f.message)
            if (gone := self.transfer.entries.pop(f.request_id, None)) is not None:
                self._release(f.request_id, gone.deadline_s)
            self.waiting.entries.pop(f.request_id, None)
            self.failed[f.request_id] = f.message
            while len(self.failed) > FAILED_MEMORY:
                self.failed.popitem(last=False)
        done.failed = failed + failed_waiting
        return done
