"""Per-worker load as the router sees it: the worker's last report plus the router's own dispatches since then.

A request's life, from the router's books::

    on_dispatch ──► queued + prefilling ──on_complete(prefill part, left_queue)──► decoding ──on_complete(decode part)

(``Selector.release`` does both parts at once; a gateway that sees the first token can release the prefill part
early with ``Selector.prefill_done``.)

Accounting keeps two books per worker and combines them with ``max``:

- **own**: this router's in-flight dispatches to the worker (``on_dispatch`` adds the request's new prefill tokens,
  new KV blocks and one queued request at once; ``on_complete`` takes them off). The next decision, even a
  concurrent one, sees them immediately: that is what stops herding between load reports.
- **reported**: the worker's last ``Load`` report, which covers what every router replica sent it.

The effective value is the larger of the two. A report can be up to one poll interval old; with ``max`` a stale
report can neither erase this router's in-flight work nor be driven negative by completions of requests it never
saw, and work from other replicas still shows through the report.

The effective values are also kept in one float64 array (row ``slot`` per worker, row 0 always zero for workers
with no record), so that scoring hundreds of candidates is a few array operations (``gather``) instead of a Python
loop over records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

WorkerId = str


@dataclass(slots=True)
class WorkerLoad:
    """One worker's load, in the router's books. Mutated only by ``LoadTracker``."""

    worker_id: WorkerId
    prefill_tokens: int = 0  # effective prompt tokens still to prefill: max(reported, own in-flight)
    decode_blocks: int = 0  # effective KV blocks held: max(reported used blocks, own in-flight)
    queue_depth: int = 0  # effective requests waiting: max(reported waiting, own in-flight)
    own: list[int] = field(default_factory=lambda: [0, 0, 0])  # this router's in-flight (prefill, blocks, queued)
    reported: list[int] = field(default_factory=lambda: [0, 0, 0])  # the worker's last report, same order
    running: int = 0  # last reported running requests
    total_blocks: int = 0  # last reported KV capacity, 0 if never reported
    draining: bool = False
    updated_at: float = 0.0  # clock() of the last change, report or dispatch
    slot: int = 0  # row in LoadTracker's effective-load array

    def refresh(self) -> None:
        own, rep = self.own, self.reported
        self.prefill_tokens = max(own[0], rep[0], 0)
        self.decode_blocks = max(own[1], rep[1], 0)
        self.queue_depth = max(own[2], rep[2], 0)

    def effective(self) -> tuple[int, int, int]:
        """``(prefill_tokens, decode_blocks, queue_depth)`` clamped at zero."""
        return max(self.prefill_tokens, 0), max(self.decode_blocks, 0), max(self.queue_depth, 0)


class LoadTracker:
    __slots__ = ("_clock", "_eff", "_free_slots", "_gather_key", "_gather_slots", "_reported_at", "_stale",
                 "_version", "_workers", "draining")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[WorkerId, WorkerLoad] = {}
        self._reported_at: dict[WorkerId, float] = {}
        self.draining: set[WorkerId] = set()  # read-only outside; kept in step with WorkerLoad.draining
        self._eff = np.zeros((3, 16))  # rows prefill_tokens, decode_blocks, queue_depth; column per slot (0 stays 0)
        self._free_slots = list(range(15, 0, -1))  # popped lowest first
        self._version = 0  # bumped when a worker gains or loses a slot
        self._gather_key: tuple[int, list[WorkerId]] = (-1, [])
        self._gather_slots = np.zeros(0, dtype=np.intp)
        self._stale: set[WorkerId] = set()  # workers whose array column is out of date

    @property
    def records(self) -> Mapping[WorkerId, WorkerLoad]:
        """Live records by worker id, read-only: the cost function's hot loop reads them directly."""
        return self._workers

    def _load(self, worker_id: WorkerId) -> WorkerLoad:
        load = self._workers.get(worker_id)
        if load is None:
            if not self._free_slots:
                old = self._eff.shape[1]
                self._eff = np.concatenate([self._eff, np.zeros((3, old))], axis=1)
                self._free_slots = list(range(2 * old - 1, old - 1, -1))
            load = self._workers[worker_id] = WorkerLoad(worker_id, slot=self._free_slots.pop())
            self._version += 1
        return load

    def _publish(self, load: WorkerLoad) -> None:
        """Refresh the record's effective values now; its array column when the array is next read (a decision
        over few candidates reads the records and never pays for numpy)."""
        load.refresh()
        self._stale.add(load.worker_id)

    def _flush(self) -> None:
        eff, workers = self._eff, self._workers
        for worker_id in self._stale:
            load = workers.get(worker_id)
            if load is not None:
                eff[:, load.slot] = (load.prefill_tokens, load.decode_blocks, load.queue_depth)
        self._stale.clear()

    def gather(self, candidates: list[WorkerId]) -> np.ndarray:
        """Effective ``prefill_tokens``, ``decode_blocks`` and ``queue_depth`` of each candidate as the three rows of
        a ``(3, n)`` array, zeros for a worker with no record: one ``take`` (a quarter of the cost of fancy indexing
        at 512 candidates), and each row comes out contiguous."""
        table, slots = self.table_and_slots(candidates)
        return table.take(slots, axis=1)

    def table_and_slots(self, candidates: list[WorkerId]) -> tuple[np.ndarray, np.ndarray]:
        """The live ``(3, capacity)`` table of effective loads (read-only outside) and each candidate's column in it
        (0, a zero column, for a worker with no record). The slots are looked up once per distinct candidate list:
        the same list keeps coming while the pool does not change."""
        if self._stale:
            self._flush()
        version, cached = self._gather_key
        if version != self._version or cached != candidates:
            workers = self._workers
            self._gather_slots = np.fromiter(((w.slot if (w := workers.get(c)) is not None else 0)
                                              for c in candidates), dtype=np.intp, count=len(candidates))
            self._gather_key = (self._version, list(candidates))
        return self._eff, self._gather_slots

    def get(self, worker_id: WorkerId) -> WorkerLoad | None:
        """The live record (treat as read-only), None for a worker never dispatched to nor reported."""
        return self._workers.get(worker_id)

    def __iter__(self) -> Iterator[WorkerLoad]:
        return iter(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def on_dispatch(self, worker_id: WorkerId, prefill_tokens: int, decode_blocks: int) -> None:
        """The router sent a request: count its uncached prompt tokens, its KV blocks and one queued request."""
        if prefill_tokens < 0 or decode_blocks < 0:
            raise ValueError(f"negative load: prefill_tokens={prefill_tokens} decode_blocks={decode_blocks}")
        load = self._load(worker_id)
        own = load.own
        own[0] += prefill_tokens
        own[1] += decode_blocks
        own[2] += 1
        self._publish(load)
        load.updated_at = self._clock()

    def on_complete(self, worker_id: WorkerId, prefill_tokens: int, decode_blocks: int,
                    left_queue: bool = True) -> None:
        """Undo (part of) a dispatch: its prefill finished and/or the request ended. ``left_queue`` once per request."""
        if prefill_tokens < 0 or decode_blocks < 0:
            raise ValueError(f"negative load: prefill_tokens={prefill_tokens} decode_blocks={decode_blocks}")
        load = self._workers.get(worker_id)
        if load is None:
            return
        own = load.own
        own[0] = max(own[0] - prefill_tokens, 0)
        own[1] = max(own[1] - decode_blocks, 0)
        if left_queue:
            own[2] = max(own[2] - 1, 0)
        self._publish(load)
        load.updated_at = self._clock()

    def update_from_report(self, worker_id: WorkerId, waiting: int, running: int, active_tokens: int,
                           used_blocks: int, total_blocks: int) -> None:
        """A worker's own load report: it replaces the router's estimate (see the module docstring)."""
        if min(waiting, running, active_tokens, used_blocks, total_blocks) < 0:
            raise ValueError(f"negative field in load report from {worker_id!r}")
        load = self._load(worker_id)
        load.reported[:] = (active_tokens, used_blocks, waiting)
        load.running = running
        load.total_blocks = total_blocks
        self._publish(load)
        load.updated_at = now = self._clock()
        self._reported_at[worker_id] = now

    def set_draining(self, worker_id: WorkerId, draining: bool = True) -> None:
        self._load(worker_id).draining = draining
        if draining:
            self.draining.add(worker_id)
        else:
            self.draining.discard(worker_id)

    def is_draining(self, worker_id: WorkerId) -> bool:
        return worker_id in self.draining

    def report_age(self, worker_id: WorkerId) -> float | None:
        """Seconds since the worker's last report, None if it never reported (a stale report means a sick worker)."""
        at = self._reported_at.get(worker_id)
        return None if at is None else self._clock() - at

    def remove(self, worker_id: WorkerId) -> None:
        load = self._workers.pop(worker_id, None)
        if load is not None:
            self._eff[:, load.slot] = 0.0
            self._free_slots.append(load.slot)
            self._free_slots.sort(reverse=True)
            self._version += 1
        self.draining.discard(worker_id)
        self._reported_at.pop(worker_id, None)
