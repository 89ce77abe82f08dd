"""Prometheus metrics of one router (a registry per router, so several can live in one process for tests).

Latency histograms use buckets suited to LLM serving: TTFT and end-to-end from 1 ms to 2 min, ITL from 0.5 ms to
5 s. Worker-side gauges (KV blocks used/free, queue depth, transfers) are read from the pool's latest ``Load``
reports at scrape time, so they are never stale by more than one poll interval.

The router's own counters and histograms are updated on every request, so they are plain numbers owned by the
event loop (an increment is an attribute add, an observation a ``bisect`` and two adds) and become Prometheus
families only when scraped. prometheus_client's own ``Counter.inc`` takes a lock and validates per call, and its
``Histogram.observe`` walks the buckets in Python: ~7 such calls per request were ~10% of the router's CPU.
Everything here is touched from the router's event loop only (the scrape handler runs on it too).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from router.pool import WorkerPool

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)


class CounterValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up, got {amount}")
        self.value += amount


class HistogramValue:
    """Bucket counts (not cumulative: ``counts[i]`` holds the observations in ``(bounds[i-1], bounds[i]]``, the
    last one those above every bound) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # Prometheus buckets are ``le``: a bound includes itself
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class _Family:
    """One metric name and its children by label values (``labels(...)`` is a dict lookup after the first)."""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], make: Callable[[], Any]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        self._make = make
        self.children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self.children[values] = self._make()
        return child


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
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
        cutoffs = CounterMetricFamily("tandem_router_worker_cutoffs", "Times a worker that answered no probe had "
                                      "its in-flight requests failed over", labels=["worker", "role"])
        for w in self.pool.workers.values():
            labels = [w.worker_id or w.address, w.role or "unknown"]
            up.add_metric(labels, 1.0 if w.healthy else 0.0)
            cutoffs.add_metric(labels, w.cutoffs)
            ld = w.last_load
            if ld is None:
                continue
            used.add_metric(labels, ld.used_blocks)
            free.add_metric(labels, ld.free_blocks)
            queue.add_metric(labels, ld.waiting)
            running.add_metric(labels, ld.running + ld.waiting_for_kv)
            transfers.add_metric(labels, ld.transfers_in_flight)
        yield from (used, free, queue, running, transfers, up, cutoffs)


class _LocalCollector(Collector):
    """The router's own counters and histograms, turned into metric families at scrape time."""

    def __init__(self) -> None:
        self.counters: list[_Family] = []
        self.histograms: list[_Family] = []
        self.computed: list[tuple[str, str, Callable[[], float]]] = []  # counters read from elsewhere

    def collect(self) -> Iterator[Metric]:
        for fam in self.counters:
            c = CounterMetricFamily(fam.name, fam.doc, labels=list(fam.labelnames))
            for values, child in fam.children.items():
                c.add_metric(list(values), child.value)
            yield c
        for name, doc, read in self.computed:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], read())
            yield c
        for fam in self.histograms:
            h = HistogramMetricFamily(fam.name, fam.doc, labels=list(fam.labelnames))
            for values, child in fam.children.items():
                h.add_metric(list(values), child.cumulative(), child.sum)
            yield h


class RouterMetrics:
    def __init__(self, pool: WorkerPool, retries: Callable[[], float] | None = None,
                 migrations: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._local = _LocalCollector()
        self.ttft: _Family = self._histogram("tandem_ttft_seconds", "Time to first token, as the client sees it",
                                             _LAT, ("mode",))
        self.itl: HistogramValue = self._histogram("tandem_itl_seconds", "Inter-token latency of streamed responses",
                                                   _ITL).labels()
        self.e2e: HistogramValue = self._histogram("tandem_e2e_latency_seconds", "End-to-end request latency",
                                                   _LAT).labels()
        self.requests: _Family = self._counter("tandem_requests", "Requests by endpoint and HTTP status",
                                               ("endpoint", "status"))
        self.admission_rejected: _Family = self._counter("tandem_admission_rejected",
                                                         "Requests refused with 429 by admission control, by tier",
                                                         ("tier",))
        self.decisions: _Family = self._counter("tandem_router_decisions", "Routing decisions by mode and reason",
                                                ("mode", "reason"))
        self.prompt_tokens: CounterValue = self._counter("tandem_prompt_tokens", "Prompt tokens received").labels()
        self.cached_tokens: CounterValue = self._counter("tandem_prompt_cached_tokens",
                                                         "Prompt tokens served from prefix cache").labels()
        self.generation_tokens: CounterValue = self._counter("tandem_generation_tokens", "Tokens generated").labels()
        if retries is not None:
            self._local.computed.append(("tandem_router_retries", "Requests retried on another worker", retries))
        if migrations is not None:
            self._local.computed.append(("tandem_router_migrations", "Streams migrated after a decode failure",
                                         migrations))
        self.registry.register(self._local)
        self.registry.register(_PoolCollector(pool))

    def _counter(self, name: str, doc: str, labelnames: tuple[str, ...] = ()) -> _Family:
        fam = _Family(name, doc, labelnames, CounterValue)
        self._local.counters.append(fam)
        return fam

    def _histogram(self, name: str, doc: str, bounds: tuple[float, ...], labelnames: tuple[str, ...] = ()) -> _Family:
        fam = _Family(name, doc, labelnames, lambda: HistogramValue(bounds))
        self._local.histograms.append(fam)
        return fam

    def render(self) -> bytes:
        return generate_latest(self.registry)
