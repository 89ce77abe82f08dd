"""A worker's own Prometheus ``/metrics`` (``tandem worker --metrics-port``): a prefill worker's KV transfers' latency
and size as histograms, per backend and outcome; a decode worker's incoming KV wait (reservation until landed or
failed) likewise; a speculating worker's speculative decoding counters (proposed and accepted tokens) with its
acceptance rate and mean accepted length, read from the engine at scrape time.

Why on the worker: the router relays each worker's ``Load`` counters (transfers, failures, bytes per backend) as
gauges and counters at scrape time, but a latency distribution is not a counter it can relay; the transfer ends on
the prefill worker's engine loop, which observes it here (a ``PrefillConnector.on_transfer`` hook) and serves the
histograms itself. The families' names, help, labels and buckets are the catalogue's (router/metric_catalogue.py,
``exporter="worker"``), which the worker may not import (docs/architecture.md), so the composition root hands them
in: one list of names, checked by tests/test_kv_transfer_metrics.py against what this module renders.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decode_worker.connector import DecodeConnector
from prefill_worker.connector import PrefillConnector, TransferTiming

TRANSFER_SECONDS = "tandem_kv_transfer_seconds"
TRANSFER_SIZE = "tandem_kv_transfer_size_bytes"
LANDING_SECONDS = "tandem_kv_landing_seconds"
SPEC_COUNTERS = {"tandem_spec_decode_drafts": "num_drafts", "tandem_spec_decode_draft_tokens": "num_draft_tokens",
                 "tandem_spec_decode_accepted_tokens": "num_accepted_tokens"}
SPEC_GAUGES = {"tandem_spec_decode_acceptance_rate": "acceptance_rate",
               "tandem_spec_decode_mean_accepted_length": "mean_accepted_length"}


class FamilySpec(Protocol):
    """What a histogram family needs from its catalogue entry (router/metric_catalogue.MetricSpec)."""

    @property
    def name(self) -> str: ...
    @property
    def help(self) -> str: ...
    @property
    def labels(self) -> tuple[str, ...]: ...
    @property
    def buckets(self) -> tuple[float, ...]: ...


class SpecCollector(Collector):
    """The engine's speculative decoding counters (``engine/spec/decoder.SpecStats``) as families at scrape time:
    every family always, with a sample once a speculating engine is attached (plain ints read across threads)."""

    def __init__(self, catalogue: Mapping[str, FamilySpec], worker_id: str, role: str) -> None:
        self._specs = catalogue
        self._labels = [worker_id, role]
        self.stats: Any = None

    def collect(self) -> Iterator[Metric]:
        for names, family in ((SPEC_COUNTERS, CounterMetricFamily), (SPEC_GAUGES, GaugeMetricFamily)):
            for name, attr in names.items():
                s = self._specs[name]
                m = family(s.name, s.help, labels=list(s.labels))
                if self.stats is not None:
                    m.add_metric(self._labels, float(getattr(self.stats, attr)))
                yield m


class WorkerMetrics:
    def __init__(self, catalogue: Mapping[str, FamilySpec], worker_id: str, role: str, backend: str) -> None:
        disable_created_metrics()  # no *_created series: only the catalogue's families (as the router renders)
        self.registry = CollectorRegistry()
        self._ids = {"worker": worker_id, "role": role, "backend": backend}

        def histogram(name: str) -> Histogram:
            s = catalogue[name]
            return Histogram(s.name, s.help, s.labels, buckets=s.buckets, registry=self.registry)

        self.seconds = histogram(TRANSFER_SECONDS)
        self.size = histogram(TRANSFER_SIZE)
        self.landing = histogram(LANDING_SECONDS)
        self.spec = SpecCollector(catalogue, worker_id, role)
        self.registry.register(self.spec)
        for outcome in ("ok", "failed"):  # every series from the first scrape, at 0: a rate sees the first transfer
            self.seconds.labels(outcome=outcome, **self._ids)
            self.landing.labels(outcome=outcome, **self._ids)
        self.size.labels(**self._ids)
        self._server: Any = None

    def transfer_ended(self, t: TransferTiming) -> None:
        """Observe one finished transfer (engine loop thread): first layer handed to the transport until DONE or
        FAILED, and, when it went through, the bytes it moved."""
        outcome = "ok" if t.ok else "failed"
        self.seconds.labels(outcome=outcome, **self._ids).observe(max(0.0, t.transfer_done - t.started))
        if t.ok:
            self.size.labels(**self._ids).observe(t.bytes_sent)

    def watch(self, connector: PrefillConnector) -> None:
        connector.on_transfer.append(self.transfer_ended)

    def landing_ended(self, ok: bool, seconds: float) -> None:
        """Observe one incoming KV wait (decode engine loop thread): reservation until landed or failed."""
        self.landing.labels(outcome="ok" if ok else "failed", **self._ids).observe(max(0.0, seconds))

    def watch_decode(self, connector: DecodeConnector) -> None:
        connector.on_landing.append(self.landing_ended)

    def watch_spec(self, stats: Any) -> None:
        """Report a speculating engine's ``SpecStats``."""
        self.spec.stats = stats

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
