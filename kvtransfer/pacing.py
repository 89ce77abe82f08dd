"""Adaptive polling for the backends that must poll (NIXL notifications and transfer states, store queues).

Right after activity a poller sleeps ``min_s`` (tens of microseconds) so per-layer latency stays low; each idle
tick doubles the sleep up to ``max_s`` (the configured ``poll_interval_s``) so idle threads cost next to nothing.
"""

from __future__ import annotations

import threading


class Backoff:
    __slots__ = ("_cur", "max_s", "min_s")

    def __init__(self, max_s: float, min_s: float = 5e-5) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"Backoff needs 0 < min_s <= max_s, got {min_s}, {max_s}")
        self.min_s, self.max_s = min_s, max_s
        self._cur = min_s

    def reset(self) -> None:
        self._cur = self.min_s

    def next_timeout(self, cap_s: float | None = None) -> float:
        """This tick's sleep (at most ``cap_s`` when given); the next one is twice as long (capped)."""
        cur = self._cur if cap_s is None else min(self._cur, cap_s)
        self._cur = min(cur * 2, self.max_s)
        return cur

    def wait(self, event: threading.Event, cap_s: float | None = None) -> bool:
        """Sleep one tick, ended early when ``event`` is set; returns whether it was set."""
        return event.wait(self.next_timeout(cap_s))
