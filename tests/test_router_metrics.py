"""The router's own metrics (router/metrics.py): plain counters and histograms turned into Prometheus families at
scrape time. The exposition is parsed back with prometheus_client's own parser."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import HistogramValue, RouterMetrics


class _NoWorkers:
    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}


def _samples(m: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_histogram_buckets_include_their_bound_and_are_cumulative() -> None:
    h = HistogramValue((0.001, 0.01, 1.0))
    for v in (0.0005, 0.001, 0.002, 0.01, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.counts == [2, 2, 2, 1]
    assert h.cumulative() == [("0.001", 2), ("0.01", 4), ("1.0", 6), ("+Inf", 7)]
    assert h.sum == pytest.approx(4.5135)


def test_render_exposes_counters_histograms_and_dispatch_stats() -> None:
    stats = {"retries": 2, "migrations": 1}
    m = RouterMetrics(_NoWorkers(), retries=lambda: stats["retries"], migrations=lambda: stats["migrations"])  # type: ignore[arg-type]
    m.requests.labels("/v1/completions", "200").inc()
    m.requests.labels("/v1/completions", "200").inc()
    m.requests.labels("other", "404").inc()
    m.prompt_tokens.inc(7)
    m.ttft.labels("colocated").observe(0.02)
    m.e2e.observe(0.003)
    m.e2e.observe(500.0)
    s = _samples(m)
    assert s[("tandem_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
    assert s[("tandem_requests_total", (("endpoint", "other"), ("status", "404")))] == 1
    assert s[("tandem_prompt_tokens_total", ())] == 7
    assert s[("tandem_router_retries_total", ())] == 2 and s[("tandem_router_migrations_total", ())] == 1
    assert s[("tandem_ttft_seconds_bucket", (("le", "0.025"), ("mode", "colocated")))] == 1
    assert s[("tandem_ttft_seconds_bucket", (("le", "0.01"), ("mode", "colocated")))] == 0
    assert s[("tandem_e2e_latency_seconds_bucket", (("le", "120.0"),))] == 1
    assert s[("tandem_e2e_latency_seconds_count", ())] == 2
    stats["retries"] = 5  # read at scrape time
    assert _samples(m)[("tandem_router_retries_total", ())] == 5


def test_counters_refuse_to_go_down_and_labels_must_match() -> None:
    m = RouterMetrics(_NoWorkers())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only go up"):
        m.generation_tokens.inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        m.requests.labels("/v1/completions")
