"""One simulated replica: the engine's real block pool, KV cache manager and scheduler, stepped by the roofline.

Lifecycle: STARTING ──startup_s──► READY ──drain──► DRAINING ──last request done──► GONE. A draining replica takes
nothing new (the router skips it) and finishes every request and transfer it holds, as DESIGN.md's drain says.

Decode-side queues (DESIGN.md's handoff): Prealloc (``prealloc``: waiting for blocks to reserve, then its prefill
starts) → Transfer (``inflight``: KV on the wire) → Waiting/Running (the scheduler's own queues).
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from operators.planner.config import Role
from sim.request import SimRequest
from sim.roofline import StepModel


class Phase(enum.IntEnum):
    STARTING = 0
    READY = 1
    DRAINING = 2
    GONE = 3


class SimWorker:
    __slots__ = ("busy", "created_s", "current", "gone_s", "inflight", "kv", "phase", "pool", "prealloc", "role",
                 "sched", "step", "tier", "worker_id")

    def __init__(self, worker_id: str, tier: str, role: Role, step: StepModel, sched: SchedulerConfig,
                 block_size: int, created_s: float, max_model_len: int) -> None:
        self.worker_id = worker_id
        self.tier = tier
        self.role = role
        self.step = step
        self.pool = BlockPool(step.kv_blocks(block_size))
        self.kv = KVCacheManager(self.pool, block_size)
        # The engine's own Scheduler, driven with SimRequest records (``sim/request.py``: the fields of a Request
        # that it reads), hence typed Any here.
        self.sched: Any = Scheduler(sched, self.kv, max_model_len)
        self.prealloc: deque[tuple[SimRequest, SimWorker, SimRequest]] = deque()  # (decode rec, prefill worker, rec)
        self.inflight = 0  # promised work: KV transfers on their way here (decode), reserved prompts (prefill)
        self.busy = False
        self.current: Any = None  # the step in flight: a SchedulerOutput of SimRequests
        self.phase = Phase.STARTING
        self.created_s = created_s
        self.gone_s = -1.0

    def start_step(self, now: float) -> float:
        """Schedule the next step at ``now``; its duration, or 0 when there is nothing to run. A record computed for
        the first time gets ``last_token_s = now`` (when a prefill starts: its KV transfer streams from then)."""
        out = self.sched.schedule()
        if not out.requests:
            return 0.0
        tokens = 0
        pairs = 0.0
        kv_tokens = 0
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            c = req.num_computed_tokens
            if req.last_token_s < 0:
                req.last_token_s = now
            tokens += n
            pairs += n * (c + (n + 1) * 0.5)
            kv_tokens += c + n
        self.current = out
        self.busy = True
        return self.step.step_time(tokens, pairs, kv_tokens)

    def idle(self) -> bool:
        return not (self.busy or self.sched.has_unfinished() or self.prealloc or self.inflight)

    def backlog_tokens(self) -> int:
        """Prompt tokens still to compute (the load report's ``active_tokens``)."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.sched.waiting)
        return waiting + sum(max(r.num_tokens - r.num_computed_tokens - 1, 0) for r in self.sched.running)

    @property
    def queue_depth(self) -> int:
        return len(self.sched.waiting) + len(self.prealloc)

    @property
    def gpus(self) -> int:
        return self.step.tp
