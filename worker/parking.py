"""Backpressure on the worker: a request whose client is not reading stops generating, instead of filling buffers.

A request is *parked* when its consumer falls behind: the router's per-request buffer is full (it sends ``pause``
on the session) or a gRPC stream's unsent backlog passed its bound (``worker/aio_stream.py``). Parking takes the
request out of the scheduler's running batch, so no step computes it, while it keeps its blocks and its place in
``scheduler.requests``: resuming appends it to the running batch again and it continues from the token after the
last one sent, token-exact. A request parked for longer than ``stall_timeout_s`` fails with a clear error (the
client read nothing for that long) and frees its blocks, so a client that stopped reading holds memory only
for a bounded time.

Parking is the worker's, not the engine's: the scheduler has no notion of a consumer, and a parked request must
neither count as work for the engine loop (it would step empty schedules back to back) nor be preempted. All of
this runs on the engine loop thread (``want``/``resume`` through ``EngineLoop.call``; ``poll`` is a loop hook).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
STALLED_MEMORY = 1024  # how many stalled request ids are remembered, to name their failure


class Parking:
    def __init__(self, stall_timeout_s: float, fail: Callable[[LLMEngine, str, str], None]) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, not {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self._fail = fail
        self.wanted: set[str] = set()  # asked to park; parked at the next hook once the request is running
        self.parked: dict[str, float] = {}  # request id -> monotonic time it was parked
        self.stalled: OrderedDict[str, None] = OrderedDict()  # recently failed for stalling

    def __len__(self) -> int:
        return len(self.parked)

    def want(self, rid: str) -> None:
        """Park ``rid`` as soon as it is in the running batch (loop thread)."""
        self.wanted.add(rid)

    def resume(self, eng: LLMEngine, rid: str) -> None:
        """Undo ``want``/park for ``rid`` (loop thread); a request that ended meanwhile is ignored."""
        self.wanted.discard(rid)
        if self.parked.pop(rid, None) is None:
            return
        req = eng.scheduler.requests.get(rid)
        if req is not None and not req.is_finished and req not in eng.scheduler.running:
            eng.scheduler.running.append(req)

    def poll(self, eng: LLMEngine) -> None:
        """Loop hook: park what was asked for, forget what ended, fail what stalled too long."""
        sch = eng.scheduler
        if self.wanted:
            now = time.monotonic()
            for rid in list(self.wanted):
                req = sch.requests.get(rid)
                if req is None or req.is_finished:
                    self.wanted.discard(rid)
                elif req in sch.running:
                    sch.running.remove(req)
                    self.wanted.discard(rid)
                    self.parked[rid] = now
        if not self.parked:
            return
        now = time.monotonic()
        for rid, since in list(self.parked.items()):
            if rid not in sch.requests:
                del self.parked[rid]
            elif now - since > self.stall_timeout_s:
                del self.parked[rid]
                self.stalled[rid] = None
                while len(self.stalled) > STALLED_MEMORY:
                    self.stalled.popitem(last=False)
                msg = (f"stream stalled: the client read nothing for {self.stall_timeout_s:g} s; request {rid} "
                       f"aborted")
                log.info("%s", msg)
                self._fail(eng, rid, msg)

    def is_stall(self, rid: str) -> bool:
        """Whether ``rid`` failed because it stalled (its error is the client's, not the worker's: not retried)."""
        return rid in self.stalled
