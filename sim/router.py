"""The router as the simulator runs it: the real KV index, load tracker, cost function and selectors, or round-robin.

Per request, as ``router/dispatch.py`` plans it: the decode worker is chosen first (``Selector.select_hashed`` over
the ready, non-draining decode workers, with the prompt's real block hashes); if what it does not cache is shorter
than ``DisaggConfig.min_uncached_tokens`` (or there is no prefill tier) the request runs colocated there, otherwise
the prefill worker is chosen the same way and the KV moves. Both selectors share one index and one load tracker, as
``router/server.py`` wires them. Workers' KV events and load reports reach the index and the tracker at the end of
every step (the real ones travel over Redis within milliseconds).

Round-robin (the baseline for the prefix hit rate) cycles through the candidates and knows no overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.cost import CostConfig
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.selector import Selector


@dataclass(slots=True, frozen=True)
class RoundRobinDecision:
    worker_id: str
    overlap_blocks: int = 0


class RoundRobin:
    """Same calls as ``Selector`` for the simulator's use; books nothing."""

    def __init__(self) -> None:
        self._next = 0

    def select_hashed(self, block_hashes: Sequence[int], num_tokens: int, workers: Sequence[str]) -> RoundRobinDecision:
        self._next += 1
        return RoundRobinDecision(workers[self._next % len(workers)])

    def prefill_done(self, decision: object) -> None:
        pass

    def release(self, decision: object) -> None:
        pass


class SimRouter:
    def __init__(self, policy: str, block_size: int, index_blocks: int, clock: object, temperature: float = 0.0,
                 seed: int = 0) -> None:
        if policy not in ("kv", "round_robin"):
            raise ValueError(f"routing policy must be 'kv' or 'round_robin', got {policy!r}")
        self.policy = policy
        self.index = KVIndex(max(index_blocks, 1))
        self.load = LoadTracker(clock)  # type: ignore[arg-type]
        cost = CostConfig(block_size=block_size, temperature=temperature)
        # Selector or RoundRobin; decisions are handed back to the one that made them.
        self.prefill: Any
        self.decode: Any
        if policy == "kv":
            self.prefill = Selector(self.index, self.load, cost, block_size, seed=seed)
            self.decode = Selector(self.index, self.load, cost, block_size, seed=seed + 1)
        else:
            self.prefill, self.decode = RoundRobin(), RoundRobin()

    def kv_events(self, worker_id: str, pool: object) -> None:
        """Apply a worker's pending KV events; on a gap, resync from its snapshot (the real consumer's path)."""
        batch = pool.take_events()  # type: ignore[attr-defined]
        if batch is not None and not self.index.apply(worker_id, batch.seq, batch.hashes, batch.kinds):
            self.index.resync(worker_id, pool.event_seq, pool.cached_hashes())  # type: ignore[attr-defined]

    def forget(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        self.load.remove(worker_id)
