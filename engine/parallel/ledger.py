"""Rank 0's record of what its follower ranks still owe, per request: the ranks whose outcome (a send ended, a
receive landed, a release done) has not been reported yet, and the first failure any of them reported.

Reports arrive on the ranks' reader threads (``engine/parallel/replica.py``); the engine loop reads. Whoever opens a
request closes it, so a report for a request no longer open (a late one, after a failure closed it) is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class RankLedger:
    def __init__(self, wake: Callable[[], object] = lambda: None, drop_settled: bool = False) -> None:
        self._lock = threading.Lock()
        self._owed: dict[str, set[int]] = {}
        self._failed: dict[str, str] = {}
        self._wake = wake
        self._drop_settled = drop_settled  # forget a request once every rank settled it (nothing to read after)

    def open(self, request_id: str, ranks: Iterable[int]) -> None:
        with self._lock:
            self._owed[request_id] = set(ranks)
            self._failed.pop(request_id, None)

    def settle(self, rank: int, request_id: str, ok: bool, error: str = "") -> None:
        """``rank`` reported ``request_id``'s outcome (reader thread); wakes the engine loop."""
        with self._lock:
            owed = self._owed.get(request_id)
            if owed is None:
                return
            owed.discard(rank)
            if not ok:
                self._failed.setdefault(request_id, error or f"rank {rank} failed")
            if self._drop_settled and not owed:
                del self._owed[request_id]
        self._wake()

    def owes(self, request_id: str) -> bool:
        """Some rank has not reported ``request_id`` yet."""
        with self._lock:
            return bool(self._owed.get(request_id))

    def failure(self, request_id: str) -> str | None:
        with self._lock:
            return self._failed.get(request_id)

    def close(self, request_id: str) -> set[int]:
        """Forget ``request_id``; the ranks that still owed it."""
        with self._lock:
            self._failed.pop(request_id, None)
            return self._owed.pop(request_id, set())

    def __len__(self) -> int:
        with self._lock:
            return len(self._owed)
