"""A prefill replica with TP ranks: rank 0's side of its followers' sends (each rank sends its own heads).

In the step that completes a request's prompt, rank 0 splits the decode side's destinations by head overlap
(``kvtransfer.plan.slice_between``): its own legs go to its sender, and each follower gets its legs with that step's
rows (``worker/rank_kv.py`` starts the send at layer 0 and hands over each layer as its forward finishes it). The
request's blocks stay held on rank 0, the only block pool, until rank 0's send ended and every follower reported its
send ended; a failure on any rank fails the request (the decode side sees its leg fail too), and a cancelled or
failed request is released on every rank still sending before its blocks are freed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from engine.parallel.ledger import RankLedger
from engine.parallel.replica import ServedReplica
from kvtransfer.base import DestinationInfo
from kvtransfer.layout import KVLayout
from kvtransfer.plan import slice_between


class PrefillRanks:
    def __init__(self, replica: ServedReplica, layout: KVLayout, wake: Callable[[], object]) -> None:
        self.replica = replica
        self.layout = layout  # rank 0's (tp_size = the replica's TP)
        self.ranks = list(range(1, replica.parallel.world_size))
        self.sending = RankLedger(wake)
        self._stopped: set[str] = set()
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}  # bytes the followers' legs sent, per request (their reports)
        replica.on_report = self._report

    def _legs(self, rank: int, dests: Sequence[DestinationInfo]) -> tuple[DestinationInfo, ...]:
        """The destinations holding some of ``rank``'s heads."""
        heads, tp = self.layout.num_kv_heads, self.layout.tp_size
        return tuple(d for d in dests
                     if slice_between(heads, tp, rank % tp, d.layout.tp_size, d.layout.tp_rank) is not None)

    def split(self, request_id: str, dests: Sequence[DestinationInfo], src_block_ids: Sequence[int],
              deadline_s: float) -> tuple[DestinationInfo, ...]:
        """Give each follower its legs with the coming step; rank 0's own legs."""
        self.sending.open(request_id, self.ranks)
        self._stopped.discard(request_id)
        for rank in self.ranks:
            legs = tuple(d.to_bytes() for d in self._legs(rank, dests))
            self.replica.attach_to_step(rank, ("send", request_id, legs, list(src_block_ids), deadline_s))
        return self._legs(0, dests)

    def owes(self, request_id: str) -> bool:
        """A follower may still read ``request_id``'s blocks (its send has not ended)."""
        return self.sending.owes(request_id)

    def failure(self, request_id: str) -> str | None:
        return self.sending.failure(request_id)

    def stop(self, request_id: str) -> None:
        """Cancel ``request_id``'s sends on the followers still sending (once); each answers when released."""
        if request_id in self._stopped or not self.sending.owes(request_id):
            return
        self._stopped.add(request_id)
        for rank in self.ranks:
            self.replica.tell(rank, ("release", request_id))

    def close(self, request_id: str) -> int:
        """Forget ``request_id``; the bytes its followers' legs sent."""
        self.sending.close(request_id)
        self._stopped.discard(request_id)
        with self._lock:
            return self._bytes.pop(request_id, 0)

    def _report(self, rank: int, payload: object) -> None:
        if not isinstance(payload, tuple):
            return
        if payload[0] == "sent":
            _, rid, ok, error, nbytes = payload
            if self.sending.owes(rid):
                with self._lock:
                    self._bytes[rid] = self._bytes.get(rid, 0) + nbytes
            self.sending.settle(rank, rid, ok, error)
        elif payload[0] == "released":
            self.sending.settle(rank, payload[1], True)
