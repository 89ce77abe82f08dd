"""Sender-side bookkeeping shared by every backend: legs, plans and per-layer progress.

One request may have several legs when the source rank's heads are spread over several destination ranks. Each leg
is planned once at ``start`` (compatibility is checked there, before any byte moves). ``layers_done`` counts the
layers every leg has handed to its transport; the request is DONE only when every leg's receiver acknowledged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.base import DestinationInfo, KVCaches, TransferState
from kvtransfer.book import Entry, TransferBook
from kvtransfer.layout import KVLayout, flat_bytes, validate_caches
from kvtransfer.plan import Piece, plan_leg


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
    extra: dict[str, Any] = field(default_factory=dict)


def as_dests(dest: DestinationInfo | Sequence[DestinationInfo]) -> list[DestinationInfo]:
    dests = [dest] if isinstance(dest, DestinationInfo) else list(dest)
    if not dests:
        raise ValueError("start() needs at least one destination")
    return dests


class Outbound:
    """Composed by every sender: registration, start-time planning and progress accounting."""

    def __init__(self, book: TransferBook, backend: str) -> None:
        self.book = book
        self.backend = backend
        self.layout: KVLayout | None = None
        self.kv_caches: KVCaches = ()
        self.num_blocks = 0

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.num_blocks = validate_caches(kv_caches, layout)
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.flat = [tuple(flat_bytes(t) for t in pair) for pair in kv_caches] if not kv_caches[0][0].is_cuda else []

    def source_bytes(self, layer: int, kv: int, piece: Piece) -> memoryview | None:
        """The source bytes of a full-head piece on CPU (a memoryview slice, no tensor ops), else None."""
        layout = self.layout
        if not self.flat or layout is None or piece.src_heads[1] - piece.src_heads[0] != layout.local_heads:
            return None
        start = piece.src_start * layout.block_bytes
        return self.flat[layer][kv][start : start + piece.nbytes]

    def open(
        self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_ids: Sequence[int],
        deadline_s: float,
    ) -> Entry:
        """Create the entry (deadline = the earlier of ours and every destination's lease)."""
        if self.layout is None:
            raise RuntimeError(f"{self.backend} sender: register() the KV caches first")
        dests = as_dests(dest)
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

    def plan(self, entry: Entry) -> None:
        """Plan every leg; on a mismatch fail the entry (peer notified) and re-raise (``CompatibilityError``)."""
        if self.layout is None:
            raise RuntimeError(f"{self.backend} sender: register() the KV caches first")
        out: Outgoing = entry.ctx
        try:
            for leg in out.legs:
                leg.pieces = plan_leg(self.layout, leg.dest.layout, out.src_ids, leg.dest.dst_block_ids)
        except ValueError as e:  # CompatibilityError included: refused before any byte moves
            self.book.fail(entry, f"sender: {e}", notify_peer=True)
            raise

    def live(self, request_id: str) -> Entry | None:
        with self.book.lock:
            entry = self.book.find(request_id)
            if entry is None or entry.state >= TransferState.DONE:
                return None
            return entry

    def leg_sent_layer(self, entry: Entry, leg: Leg, nbytes: int) -> None:
        with self.book.lock:
            leg.layers_sent += 1
            entry.nbytes += nbytes
            entry.layers_done = min(lg.layers_sent for lg in entry.ctx.legs)

    def leg_acked(self, entry: Entry, leg: Leg) -> None:
        with self.book.lock:
            leg.acked = True
            if all(lg.acked for lg in entry.ctx.legs):
                self.book.done(entry)
