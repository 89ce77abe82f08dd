"""Open-loop pacing: with ``--rate R`` every user draws its next start time from one shared schedule, a slot every
1/R seconds, so the arrivals stay at R/s however long responses take (as long as a user is free: the open-loop
shape keeps ``--max-users`` of them). Without ``--rate`` the wrapped wait time applies (closed loop)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class _Schedule:
    def __init__(self) -> None:
        self.next_at: float | None = None

    def wait(self, rate: float) -> float:
        now = time.monotonic()
        if self.next_at is None or self.next_at < now - 1.0:  # start, or a backlog of more than a second: resync
            self.next_at = now
        slot = self.next_at
        self.next_at = slot + 1.0 / rate
        return max(0.0, slot - now)


SCHEDULE = _Schedule()


def paced_wait(closed: Callable[[Any], float]) -> Callable[[Any], float]:
    def wait(user: Any) -> float:
        opts = user.environment.parsed_options
        if opts is not None and opts.rate > 0:
            return SCHEDULE.wait(opts.rate)
        return closed(user)

    return wait
