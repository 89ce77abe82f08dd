"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption by recompute.

There is no prefill phase and no decode phase. Each step the scheduler hands out a token budget: first to running
requests in arrival order (a decode needs one token, an unfinished chunked prefill needs its next chunk), then to
waiting requests, whose cached prefix is attached before they are charged for the rest. When the block pool runs
dry, the most recently arrived running request is preempted: its blocks go back to the pool (they stay in the
prefix cache), its ``num_computed_tokens`` drops to zero and it returns to the front of the waiting queue, to be
recomputed later, mostly from cache.

Requests in ``WAITING_FOR_REMOTE_KV`` hold their blocks but are not scheduled until the KV arrives
(:meth:`Scheduler.remote_kv_ready`). With a KV connector (``engine/kv_connector.py``) the connector decides which new
requests wait for remote KV, and which finished requests' blocks stay held for a send until :meth:`free_held`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: the requests to run and how many new tokens each computes, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 connector: KVConnector | None = None) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        # A sequence longer than the whole cache would preempt itself forever.
        self.max_model_len = min(max_model_len, kv.pool.num_blocks * kv.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> bool:
        """Queue ``request``. False only for a request whose remote KV (the connector's call) needs more blocks than
        are free now; nothing is kept then. ValueError if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        need = self.kv.blocks_needed(request.num_tokens + 1)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt needs {need} KV blocks, the cache has {self.kv.pool.num_blocks} in all")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens leaves no room to generate within max_model_len="
                f"{self.max_model_len}"
            )
        if self.connector is not None:
            num_remote = self.connector.num_remote_tokens(request)
            if num_remote:
                return self.add_remote(request, num_remote)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        scheduled: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                scheduled.add(req.request_id)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted; everything behind it is gone too

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits = kv.get_computed_blocks(req)
                num_cached = len(hits) * kv.block_size
                num_new = min(req.num_tokens - num_cached, budget)
                if not kv.allocate_slots(req, num_new, hits):
                    break
                self.waiting.popleft()
                req.num_computed_tokens = num_cached
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                budget -= num_new
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` for everything that ran."""
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            req.num_computed_tokens += n

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Move a request to a finished state and free its blocks, or hold them if the connector still sends from
        them (freed by :meth:`free_held`). Idempotent."""
        if req.is_finished:
            return
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                self.remote.pop(req.request_id, None)
        if self.connector is not None and self.connector.request_finished(req, list(self.kv.block_ids(
                req.request_id))):
            self.kv.hold(req)
        else:
            self.kv.free(req)
        del self.requests[req.request_id]

    def free_held(self, request_id: str) -> int:
        """Free the blocks held for a finished request's send; how many (0 if none are held)."""
        return self.kv.free_held(request_id)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    # Remote KV (disaggregated decode): blocks are reserved up front, the request waits for the transfer.

    def add_remote(self, request: Request, num_remote_tokens: int) -> bool:
        """Reserve blocks for ``num_remote_tokens`` of KV that another engine will write. False if no room."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not 0 < num_remote_tokens < request.num_tokens + 1:
            raise ValueError(f"num_remote_tokens={num_remote_tokens} must be in [1, {request.num_tokens}]")
        if not self.kv.allocate_slots(request, num_remote_tokens, publish=False):
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return True

    def remote_kv_ready(self, request_id: str, num_tokens: int) -> None:
        """The remote KV for the first ``num_tokens`` tokens landed: the request joins the running batch."""
        req = self.remote.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        if not 0 <= num_tokens < req.num_tokens:
            raise ValueError(f"remote KV for {num_tokens} tokens leaves nothing to compute for a request of "
                             f"{req.num_tokens} tokens")
        del self.remote[request_id]
        req.num_computed_tokens = num_tokens
        self.kv.cache_computed(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
