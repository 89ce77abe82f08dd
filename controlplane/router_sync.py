"""Keeps an in-process router's worker pool in step with the controller (``tandem up``).

A replica is added to the pool when it is ready and counts as registered once the pool has found it healthy; it
is marked draining in the pool the moment the controller decides to drain it, before the worker's own ``Drain``
makes it refuse work, so that no request is sent to it after that point (the pool's ``available()`` skips
draining workers for prefill and decode alike, while requests already on it run to the end); it leaves the pool
only after its drain is complete. The pool is duck-typed (router/pool.py ``WorkerPool``): the control plane does
not import the router.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from controlplane.replica_state import Replica


class PoolLike(Protocol):
    workers: dict[str, Any]

    def add(self, address: str) -> Any: ...
    async def remove(self, address: str) -> None: ...


class RouterSync:
    def __init__(self, pool: PoolLike, ready_timeout_s: float = 60.0) -> None:
        self.pool = pool
        self.ready_timeout_s = ready_timeout_s

    async def ready(self, replica: Replica) -> None:
        w = self.pool.add(replica.address)
        deadline = time.monotonic() + self.ready_timeout_s
        while not w.healthy:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router found {replica.address} unhealthy for {self.ready_timeout_s}s")
            await asyncio.sleep(0.05)

    def draining(self, replica: Replica) -> None:
        w = self.pool.workers.get(replica.address)
        if w is not None:
            w.draining = True

    async def removed(self, replica: Replica) -> None:
        await self.pool.remove(replica.address)
