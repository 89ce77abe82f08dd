"""A decode replica with TP ranks: rank 0's side of its followers' receives (each rank lands its own heads).

``Reserve`` reserves the blocks on rank 0 (the only block pool) and asks every follower to open a receive on the same
block ids in its own receiver (``worker/rank_kv.py``); the reply carries one destination per decode rank
(:func:`encode_destinations`), and the prefill side sends each of its ranks' head slices to the decode ranks whose
heads overlap. A request is landed only when rank 0's receiver and every follower reported it landed; a failure
reported by any rank fails it. Releasing it (landed, failed, aborted, finished) releases it on every rank, and a
follower answers each release once nothing can be written into its blocks any more (NIXL: its senders are quiet), so
:meth:`DecodeRanks.outstanding` counts the follower reservations still alive, and the decode connector keeps a
request's blocks held until :meth:`DecodeRanks.released`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from engine.parallel.ledger import RankLedger
from engine.parallel.replica import ServedReplica
from kvtransfer.base import DestinationInfo


def encode_destinations(dests: Sequence[DestinationInfo]) -> bytes:
    """``ReserveResponse.destination``: one destination as itself (what a single-rank decode always sent), several
    (one per decode rank, rank 0 first) as a JSON array of them; ``prefill_worker.connector.Bootstrap`` parses both."""
    if len(dests) == 1:
        return dests[0].to_bytes()
    return b"[" + b",".join(d.to_bytes() for d in dests) + b"]"


class DecodeRanks:
    def __init__(self, replica: ServedReplica, wake: Callable[[], object]) -> None:
        self.replica = replica
        self.ranks = list(range(1, replica.parallel.world_size))
        self.landing = RankLedger(wake)
        self.releasing = RankLedger(drop_settled=True)
        replica.on_report = self._report

    def reserve(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                deadline_s: float) -> list[DestinationInfo]:
        """Open the receive on every follower (rank 1 first); raises, having released it everywhere, if one fails."""
        self.landing.open(request_id, self.ranks)
        try:
            answers = self.replica.call(("reserve", request_id, list(block_ids), num_tokens, deadline_s))
            return [DestinationInfo.from_bytes(cast(bytes, a)) for a in answers]
        except Exception:
            self.release(request_id)
            raise

    def state(self, request_id: str) -> tuple[bool, str | None]:
        """(every follower landed it, the first failure a follower reported)."""
        return not self.landing.owes(request_id), self.landing.failure(request_id)

    def release(self, request_id: str) -> None:
        self.landing.close(request_id)
        self.releasing.open(request_id, self.ranks)
        for rank in self.ranks:
            self.replica.tell(rank, ("release", request_id))

    def released(self, request_id: str) -> bool:
        """Every follower answered ``request_id``'s release: none can still have bytes written into its blocks."""
        return not self.releasing.owes(request_id)

    def outstanding(self) -> int:
        """Follower reservations not yet released (alive on some rank)."""
        return len(self.landing) + len(self.releasing)

    def _report(self, rank: int, payload: object) -> None:
        if not isinstance(payload, tuple):
            return
        if payload[0] == "landed":
            _, rid, ok, error = payload
            self.landing.settle(rank, rid, ok, error)
        elif payload[0] == "released":
            self.releasing.settle(rank, payload[1], True)
