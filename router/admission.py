"""Admission control: a bounded number of requests in this router at once, per worker tier; beyond it, 429.

Overload is shed here, at the door, with ``429`` and ``Retry-After``, instead of queueing without bound in the
router and the workers until TTFTs grow past any client's timeout and busy workers look dead. Every request that
generates takes one slot from admission to its last byte (streams included); the bound grows with the workers that
are up in each tier::

    limit(tier) = per_worker[tier] * available(tier)

A request is admitted while the router's requests in flight are below the limit of every tier that has workers
(the decode tier serves every request; the prefill tier is counted too when it has workers, since a disaggregated
request holds a prefill worker's queue first). A second signal, each decode worker's own queue as its ``Load``
reports it, refuses when the workers report more waiting requests than ``max_waiting_per_worker`` each, which
catches load from other router replicas that this router's count does not see.

The count is this process's own: ``--processes N`` routers each admit up to the limit, so size ``per_worker`` for
one process's share. Refusals are counted per tier in ``tandem_admission_rejected_total``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.api_error import APIError
from router.metrics import RouterMetrics
from router.pool import WorkerPool


@dataclass(slots=True, frozen=True)
class AdmissionConfig:
    max_per_decode_worker: int = 256  # requests in flight in this router, per decode (or colocated) worker
    max_per_prefill_worker: int = 256  # ... per prefill worker, when the prefill tier has workers
    max_waiting_per_worker: int = 256  # the workers' own queues (Load.waiting), averaged over decode workers
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_per_decode_worker", "max_per_prefill_worker", "max_waiting_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")


class Admission:
    """``enter()`` admits one request or raises the ``APIError`` to answer; ``leave()`` when it is done."""

    def __init__(self, config: AdmissionConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.in_flight = 0
        self.rejected = metrics.admission_rejected

    def enter(self) -> None:
        cfg = self.config
        decode = self.pool.available("decode")
        if not decode:
            raise APIError(503, "no decode worker is available", retry_after=cfg.retry_after_s)
        if self.in_flight >= cfg.max_per_decode_worker * len(decode):
            self._refuse("decode", f"server overloaded: {self.in_flight} requests in flight")
        prefill = self.pool.available("prefill")
        if prefill and self.in_flight >= cfg.max_per_prefill_worker * len(prefill):
            self._refuse("prefill", f"server overloaded: {self.in_flight} requests in flight")
        waiting = sum(w.last_load.waiting for w in decode if w.last_load is not None)
        if waiting > cfg.max_waiting_per_worker * len(decode):
            self._refuse("decode", f"server overloaded: {waiting} requests queued on the workers")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    def _refuse(self, tier: str, message: str) -> None:
        self.rejected.labels(tier).inc()
        raise APIError(429, message, err_type="rate_limit_error", retry_after=self.config.retry_after_s)


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` in whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
