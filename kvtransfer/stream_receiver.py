"""The request-side half shared by receivers whose bytes arrive over a stream they read themselves (TCP, torch).

Bytes land through :class:`Landing` on this receiver's own threads, so ``release`` fails the lease and then waits
for any write in progress to end before forgetting the request: nothing is written into blocks after release.
(NIXL writes one-sidedly and the fake copies synchronously, so they release without that wait.)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.base import DestinationInfo, KVReceiver, TransferStatus
from kvtransfer.book import TransferBook
from kvtransfer.landing import Landing


class StreamReceiver(KVReceiver):
    book: TransferBook
    landing: Landing
    endpoint: str

    def reserve(
        self, request_id: str, dst_block_ids: Sequence[int], num_tokens: int, deadline_s: float
    ) -> DestinationInfo:
        return self.landing.reserve(request_id, dst_block_ids, num_tokens, deadline_s, endpoint=self.endpoint)

    def poll(self, request_id: str) -> TransferStatus:
        return self.book.status(request_id)

    def release(self, request_id: str) -> None:
        entry = self.book.find(request_id)
        if entry is None:
            return
        self.book.fail(entry, "receiver: released before completion", notify_peer=True, tell_owner=False)
        self.book.wait_idle(entry, self.config.close_timeout_s)
        self.landing.forget(request_id)
