"""The workers' own ``/metrics`` (worker/metrics.py): a prefill worker's KV transfers' latency and size histograms
and a decode worker's incoming KV wait (reservation until landed), per backend and outcome, named by the catalogue
(router/metric_catalogue.py, ``exporter="worker"``). The families it renders are exactly the catalogue's worker
entries, help and type included; and every dashboard panel that queries them returns a finite sample from a real
Prometheus scraping a real prefill and a real decode worker process after one disaggregated request through a
router (tcp backend)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread
from prom_harness import Prometheus, free_port, grafana_expr
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_dashboards import NAMES, dashboards, panel_queries
from test_dashboards_live import _constants

from prefill_worker.connector import TransferTiming
from router.metric_catalogue import WORKER_METRICS
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker
from worker.metrics import WorkerMetrics


def _samples(m: WorkerMetrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}


def test_the_worker_renders_exactly_the_catalogues_worker_families_and_counts_a_failure_apart() -> None:
    m = WorkerMetrics(WORKER_METRICS, "p0", "prefill", "tcp")
    m.transfer_ended(TransferTiming("a", compute_done=1.0, transfer_done=1.25, ok=True, started=1.0,
                                    bytes_sent=1 << 20))
    m.transfer_ended(TransferTiming("b", compute_done=2.0, transfer_done=7.0, ok=False, started=2.0))
    m.landing_ended(True, 0.5)  # a decode worker's incoming KV wait (the same class serves either role)
    m.landing_ended(False, 3.0)
    fams = _samples(m)
    assert set(fams) == set(WORKER_METRICS)
    for name, f in fams.items():
        assert f.documentation == WORKER_METRICS[name].help and f.type == WORKER_METRICS[name].kind, name
    counts = {(s.labels.get("outcome"), s.name): s.value for f in fams.values() for s in f.samples
              if s.name.endswith(("_count", "_sum"))}
    assert counts[("ok", "tandem_kv_transfer_seconds_sum")] == pytest.approx(0.25)
    assert counts[("failed", "tandem_kv_transfer_seconds_sum")] == pytest.approx(5.0)
    assert counts[(None, "tandem_kv_transfer_size_bytes_count")] == 1  # a failed send moved no whole KV
    assert counts[(None, "tandem_kv_transfer_size_bytes_sum")] == 1 << 20
    assert counts[("ok", "tandem_kv_landing_seconds_sum")] == pytest.approx(0.5)
    assert counts[("failed", "tandem_kv_landing_seconds_sum")] == pytest.approx(3.0)


def _worker_panels() -> list[tuple[str, str, str]]:
    """(dashboard, panel, PromQL with Grafana's variables substituted) of every query naming a worker-served
    family."""
    out = []
    for name, dash in dashboards().items():
        variables = _constants(dash)
        for title, expr in panel_queries(dash):
            if any(n.startswith(tuple(WORKER_METRICS)) for n in NAMES.findall(expr)):
                out.append((name, title, grafana_expr(expr, variables)))
    return out


@pytest.mark.slow
def test_kv_transfer_panels_return_data_from_prometheus_scraping_a_prefill_and_a_decode_worker(
        checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    panels = _worker_panels()
    assert panels, "no dashboard panel queries the workers' KV transfer histograms"
    model = str(checkpoint("llama"))
    port, decode_port = free_port(), free_port()
    workers: list[WorkerProcess] = []
    rt = prom = None
    try:
        workers = [start_worker("prefill", model, "tcp", [*WORKER_FLAGS, "--worker-id", "km-prefill",
                                                          "--metrics-port", str(port)]),
                   start_worker("decode", model, "tcp", [*WORKER_FLAGS, "--worker-id", "km-decode",
                                                     "--metrics-port", str(decode_port)])]
        assert [w.metrics_port for w in workers] == [port, decode_port]  # advertised to the launcher
        prom = Prometheus([f"127.0.0.1:{port}", f"127.0.0.1:{decode_port}"], tmp_path)
        # both scraped at 0 before the request: a series whose first sample is already 1 has no rate yet
        prom.wait_for('tandem_kv_transfer_seconds_count{outcome="ok",worker="km-prefill"} == 0')
        prom.wait_for('tandem_kv_landing_seconds_count{outcome="ok",worker="km-decode"} == 0')
        rt = RouterThread(RouterConfig(model=model, workers=tuple(w.address for w in workers), min_uncached_tokens=32))
        with httpx.Client(base_url=rt.url, timeout=60) as c:
            served = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", json={"model": served, "max_tokens": 4, "ignore_eos": True,
                                                "prompt": "a long prompt that goes through prefill first " * 8})
            assert r.status_code == 200, r.text
        prom.wait_for('tandem_kv_transfer_seconds_count{backend="tcp",outcome="ok",worker="km-prefill"} == 1')
        prom.wait_for('tandem_kv_landing_seconds_count{backend="tcp",outcome="ok",worker="km-decode"} == 1')
        for dash, title, q in panels:
            result = prom.wait_for(q, timeout_s=30)
            assert {s["metric"].get("backend") for s in result} == {"tcp"}, (dash, title, result)
    finally:
        if prom is not None:
            prom.stop()
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()
