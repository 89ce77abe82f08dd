"""Prometheus metrics of one router (a registry per router, so several can live in one process for tests).

Every name, help text and bucket list comes from router/metric_catalogue.py. Worker-side gauges (KV blocks
used/free, queue depth, running requests, transfers) are read from the pool's latest ``Load`` reports at scrape
time, so they are never stale by more than one poll interval; tier replicas from the controller's status when one is
attached (``tandem up``). With ``vllm_names`` every family that has a vLLM equivalent is exported a second time under
its ``vllm:*`` name with a ``model_name`` label, so that dashboards built for vLLM work unchanged.

The router's own counters and histograms are updated on every request, so they are plain numbers owned by the
event loop (an increment is an attribute add, an observation a ``bisect`` and two adds) and become Prometheus
families only when scraped. prometheus_client's own ``Counter.inc`` takes a lock and validates per call, its
``Histogram.observe`` walks the buckets in Python, and every request makes several such calls (docs/benchmarks.md
section 5, change 6).
Everything here is touched from the router's event loop only (the scrape handler runs on it too).

``tandem_requests_total`` counts every response the gateway's ASGI app sends (router/asgi.py), by endpoint and
status: 4xx and 5xx, and the 408, 413, 414, 431 and 499 of the HTTP edge, included (router/asgi.py enforces the
request-target and header limits itself, so that those refusals are counted). Not counted, because they cannot be:
the 414 and 431 that granian's HTTP parser (hyper) sends itself for a head past its read buffer, a backstop
``HEAD_BACKSTOP`` times the app's header limit, before closing the connection. The app is never called for such a
request (no ASGI scope exists; the path to count it under is inside the refused head). granian (2.8) offers no hook
for it: it drops hyper's connection error without logging it, and its own Prometheus exporter (``--metrics``, which
its embedded server, the one ``tandem up`` runs, refuses) counts such a connection in ``granian_connections_handled``
only, so even there it cannot be told from a connection that sent nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from router.metric_catalogue import EXTRA_VLLM_ALIASES, VLLM_ALIASES, MetricSpec, spec
from router.pool import WorkerPool

TierReplicas = Callable[[], dict[str, tuple[int, int]]]  # tier -> (desired, ready)


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


def _gauge(name: str) -> GaugeMetricFamily:
    m = spec(name)
    return GaugeMetricFamily(m.name, m.help, labels=list(m.labels))


def _counter(name: str) -> CounterMetricFamily:
    m = spec(name)
    return CounterMetricFamily(m.name, m.help, labels=list(m.labels))


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool, tiers: TierReplicas | None) -> None:
        self.pool = pool
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        used, free, usage = (_gauge("tandem_kv_blocks_used"), _gauge("tandem_kv_blocks_free"),
                             _gauge("tandem_kv_cache_usage_ratio"))
        queue, running = _gauge("tandem_worker_queue_depth"), _gauge("tandem_worker_running_requests")
        transfers, up = _gauge("tandem_kv_transfers_in_flight"), _gauge("tandem_worker_up")
        generated = _gauge("tandem_worker_generated_tokens")
        cutoffs, kv_done, kv_failed, kv_bytes, kv_seconds = (_counter(n) for n in (
            "tandem_router_worker_cutoffs", "tandem_kv_transfers", "tandem_kv_transfer_failures",
            "tandem_kv_transfer_bytes", "tandem_kv_transfer_exposed_seconds"))
        for w in self.pool.workers.values():
            labels = [w.worker_id or w.address, w.role or "unknown"]
            up.add_metric(labels, 1.0 if w.healthy else 0.0)
            cutoffs.add_metric(labels, w.cutoffs)
            ld = w.last_load
            if ld is None:
                continue
            used.add_metric(labels, ld.used_blocks)
            free.add_metric(labels, ld.free_blocks)
            usage.add_metric(labels, ld.used_blocks / ld.total_blocks if ld.total_blocks else 0.0)
            queue.add_metric(labels, ld.waiting)
            running.add_metric(labels, ld.running + ld.waiting_for_kv)
            transfers.add_metric(labels, ld.transfers_in_flight)
            generated.add_metric(labels, ld.generated_tokens)
            if w.role == "prefill":
                kv = [*labels, w.kv_backend or "unknown"]
                kv_done.add_metric(kv, ld.kv_transfers_done)
                kv_failed.add_metric(kv, ld.kv_transfers_failed)
                kv_bytes.add_metric(kv, ld.kv_transfer_bytes)
                kv_seconds.add_metric(kv, ld.kv_transfer_exposed_us / 1e6)
        yield from (used, free, usage, queue, running, transfers, up, cutoffs, generated, kv_done, kv_failed, kv_bytes,
                    kv_seconds)
        if self.tiers is not None:
            desired, ready = _gauge("tandem_tier_replicas_desired"), _gauge("tandem_tier_replicas_ready")
            for tier, (d, r) in sorted(self.tiers().items()):
                desired.add_metric([tier], d)
                ready.add_metric([tier], r)
            yield from (desired, ready)


class _LocalCollector(Collector):
    """The router's own counters and histograms, turned into metric families at scrape time."""

    def __init__(self) -> None:
        self.counters: list[_Family] = []
        self.histograms: list[_Family] = []
        self.computed: list[tuple[MetricSpec, Callable[[], float]]] = []  # read from elsewhere at scrape time

    def collect(self) -> Iterator[Metric]:
        for fam in self.counters:
            c = CounterMetricFamily(fam.name, fam.doc, labels=list(fam.labelnames))
            for values, child in fam.children.items():
                c.add_metric(list(values), child.value)
            yield c
        for m, read in self.computed:
            f: Metric = (CounterMetricFamily(m.name, m.help) if m.kind == "counter"
                         else GaugeMetricFamily(m.name, m.help))
            f.add_metric([], read())  # type: ignore[attr-defined]
            yield f
        for fam in self.histograms:
            h = HistogramMetricFamily(fam.name, fam.doc, labels=list(fam.labelnames))
            for values, child in fam.children.items():
                h.add_metric(list(values), child.cumulative(), child.sum)
            yield h


class _VllmNames(Collector):
    """Every family of ``sources`` that has a vLLM equivalent, again under its ``vllm:*`` name(s), each sample with
    a ``model_name`` label (what vLLM's dashboards filter on)."""

    def __init__(self, sources: Iterable[Collector], model_name: str) -> None:
        self.sources = tuple(sources)
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for fam in source.collect():
                names = (VLLM_ALIASES.get(fam.name), *EXTRA_VLLM_ALIASES.get(fam.name, ()))
                for alias in names:
                    if alias is None:
                        continue
                    out = Metric(alias, fam.documentation, fam.type)
                    for s in fam.samples:
                        out.add_sample(alias + s.name[len(fam.name):], {**s.labels, "model_name": self.model_name},
                                       s.value)
                    yield out


class RouterMetrics:
    def __init__(self, pool: WorkerPool, retries: Callable[[], float] | None = None,
                 migrations: Callable[[], float] | None = None, model_name: str = "",
                 vllm_names: bool = False, tiers: TierReplicas | None = None) -> None:
        self.registry = CollectorRegistry()
        self._local = _LocalCollector()
        self.ttft: _Family = self._histogram("tandem_ttft_seconds")
        for mode in ("colocated", "disaggregated"):  # exported from the start: a rate() needs the series' zero
            self.ttft.labels(mode)
        self.itl: HistogramValue = self._histogram("tandem_itl_seconds").labels()
        self.e2e: HistogramValue = self._histogram("tandem_e2e_latency_seconds").labels()
        self.queue_time: HistogramValue = self._histogram("tandem_request_queue_time_seconds").labels()
        self.prefill_time: HistogramValue = self._histogram("tandem_request_prefill_time_seconds").labels()
        self.decode_time: HistogramValue = self._histogram("tandem_request_decode_time_seconds").labels()
        self.inference_time: HistogramValue = self._histogram("tandem_request_inference_time_seconds").labels()
        self.request_prompt_tokens: HistogramValue = self._histogram("tandem_request_prompt_tokens").labels()
        self.request_generation_tokens: HistogramValue = self._histogram("tandem_request_generation_tokens").labels()
        self.request_max_tokens: HistogramValue = self._histogram("tandem_request_max_num_generation_tokens").labels()
        self.requests: _Family = self._counter("tandem_requests")
        self.success: _Family = self._counter("tandem_request_success")
        self.admission_rejected: _Family = self._counter("tandem_admission_rejected")
        for tier in ("prefill", "decode"):
            self.admission_rejected.labels(tier)
        self.decisions: _Family = self._counter("tandem_router_decisions")
        self.prompt_tokens: CounterValue = self._counter("tandem_prompt_tokens").labels()
        self.cached_tokens: CounterValue = self._counter("tandem_prompt_cached_tokens").labels()
        self.generation_tokens: CounterValue = self._counter("tandem_generation_tokens").labels()
        prompt, cached = self.prompt_tokens, self.cached_tokens
        self._local.computed.append((spec("tandem_prefix_cache_hit_rate"),
                                     lambda: cached.value / prompt.value if prompt.value else 0.0))
        if retries is not None:
            self._local.computed.append((spec("tandem_router_retries"), retries))
        if migrations is not None:
            self._local.computed.append((spec("tandem_router_migrations"), migrations))
        self._pool_collector = pool_collector = _PoolCollector(pool, tiers)
        self.registry.register(self._local)
        self.registry.register(pool_collector)
        if vllm_names:
            self.registry.register(_VllmNames((self._local, pool_collector), model_name))

    def attach_tiers(self, tiers: TierReplicas) -> None:
        """Export each tier's desired and ready replicas, read from ``tiers()`` at every scrape (the controller)."""
        self._pool_collector.tiers = tiers

    def _counter(self, name: str) -> _Family:
        m = spec(name)
        fam = _Family(m.name, m.help, m.labels, CounterValue)
        self._local.counters.append(fam)
        return fam

    def _histogram(self, name: str) -> _Family:
        m = spec(name)
        bounds = m.buckets
        fam = _Family(m.name, m.help, m.labels, lambda: HistogramValue(bounds))
        self._local.histograms.append(fam)
        return fam

    def request_done(self, prompt_tokens: int, generated: list[int], finish_reasons: Iterable[str | None],
                     t0: float, dispatched: float, first_token: float, end: float) -> None:
        """One finished request: its phases (arrival ``t0``, handed to routing at ``dispatched``, first token,
        last token; perf_counter seconds, ``first_token`` 0 when none came), its token counts per sequence and
        each sequence's finish reason."""
        self.queue_time.observe(dispatched - t0)
        self.inference_time.observe(end - dispatched)
        if first_token:
            self.prefill_time.observe(first_token - dispatched)
            self.decode_time.observe(end - first_token)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(sum(generated))
        self.request_max_tokens.observe(max(generated, default=0))
        for reason in finish_reasons:
            self.success.labels(reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
