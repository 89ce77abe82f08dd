"""Prometheus metrics of one router (a registry per router, so several can live in one process for tests).

Latency histograms use buckets suited to LLM serving: TTFT and end-to-end from 1 ms to 2 min, ITL from 0.5 ms to
5 s. Worker-side gauges (KV blocks used/free, queue depth, transfers) are read from the pool's latest ``Load``
reports at scrape time, so they are never stale by more than one poll interval.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.pool import WorkerPool

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        used = GaugeMetricFamily("tandem_kv_blocks_used", "KV cache blocks in use", labels=["worker", "role"])
        free = GaugeMetricFamily("tandem_kv_blocks_free", "KV cache blocks free (incl. evictable cached)",
                                 labels=["worker", "role"])
        queue = GaugeMetricFamily("tandem_worker_queue_depth", "Requests waiting to be scheduled",
                                  labels=["worker", "role"])
        running = GaugeMetricFamily("tandem_worker_running_requests", "Requests running or receiving KV",
                                    labels=["worker", "role"])
        transfers = GaugeMetricFamily("tandem_kv_transfers_in_flight", "KV transfers in flight",
                                      labels=["worker", "role"])
        up = GaugeMetricFamily("tandem_worker_up", "1 if the worker answers health checks", labels=["worker", "role"])
        for w in self.pool.workers.values():
            labels = [w.worker_id or w.address, w.role or "unknown"]
            up.add_metric(labels, 1.0 if w.healthy else 0.0)
            ld = w.last_load
            if ld is None:
                continue
            used.add_metric(labels, ld.used_blocks)
            free.add_metric(labels, ld.free_blocks)
            queue.add_metric(labels, ld.waiting)
            running.add_metric(labels, ld.running + ld.waiting_for_kv)
            transfers.add_metric(labels, ld.transfers_in_flight)
        yield from (used, free, queue, running, transfers, up)


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tandem_ttft_seconds", "Time to first token, as the client sees it",
                              ["mode"], buckets=_LAT, registry=r)
        self.itl = Histogram("tandem_itl_seconds", "Inter-token latency of streamed responses", buckets=_ITL,
                             registry=r)
        self.e2e = Histogram("tandem_e2e_latency_seconds", "End-to-end request latency", buckets=_LAT, registry=r)
        self.queue_time = Histogram("tandem_queue_time_seconds", "Time from arrival to dispatch", buckets=_LAT,
                                    registry=r)
        self.requests = Counter("tandem_requests_total", "Requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.decisions = Counter("tandem_router_decisions_total", "Routing decisions by mode and reason",
                                 ["mode", "reason"], registry=r)
        self.retries = Counter("tandem_router_retries_total", "Requests retried on another worker", registry=r)
        self.migrations = Counter("tandem_router_migrations_total", "Streams migrated after a decode failure",
                                  registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens_total", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("tandem_prompt_cached_tokens_total", "Prompt tokens served from prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens_total", "Tokens generated", registry=r)
        r.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)
