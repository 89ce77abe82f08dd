"""Every panel of the chart's Grafana dashboards returns data: ``tandem up`` (real Ray, a prefill and a decode
worker process, the router) scraped by a real Prometheus, a short bounded load (streamed and whole, short prompts
run colocated and long ones disaggregated, a repeated prompt for prefix hits, one bad request for the errors
panel), then each panel's PromQL through Prometheus' HTTP API with Grafana's variables substituted. No Grafana
server runs here; a panel whose metric the code does not export returns nothing and fails. Prometheus finds its
targets as a user's would, in the file_sd file ``tandem up`` keeps (controlplane/prometheus_targets.py): the router
and each worker's own ``/metrics`` (router/metric_catalogue.py's ``exporter="worker"`` families, such as the prefill
workers' KV transfer histograms), so the worker panels are proven here too."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prom_harness import Prometheus, grafana_expr
from test_dashboards import dashboards, panel_queries
from test_tandem_up import Cluster

pytestmark = pytest.mark.slow


def _load(url: str, model: str) -> None:
    long_prompt = "a long shared context about serving " * 20
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(8):
            body = {"model": model, "prompt": (long_prompt if i % 2 else "") + f"question {i % 4}", "max_tokens": 6,
                    "ignore_eos": True, "stream": i % 3 != 2}
            if body["stream"]:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
            else:
                assert c.post("/v1/completions", json=body).status_code == 200
        assert c.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}).status_code == 400


def _constants(dash: dict[str, object]) -> dict[str, str]:
    """Grafana's variable values: constants as written, the worker picker on All."""
    out = {}
    for var in dash["templating"]["list"]:  # type: ignore[index]
        if var["type"] == "constant":
            out[var["name"]] = var["query"]
        elif var["type"] == "query":
            out[var["name"]] = var["allValue"]
    return out


def test_every_dashboard_panel_returns_data_from_tandem_up(checkpoint: Callable[[str], Path],
                                                           tmp_path: Path) -> None:
    cluster = Cluster(checkpoint("llama"), tmp_path / "home")
    prom = None
    try:
        prom = Prometheus([], tmp_path, file_sd=Path(cluster.state["prometheus_targets"]))
        prom.wait_for('up{exporter="router"} == 1')
        prom.wait_for('count(up{exporter="worker"} == 1) == 2')  # the prefill and the decode worker's /metrics
        model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        _load(cluster.url, model)
        prom.wait_for('sum(tandem_router_decisions_total{mode="disaggregated"}) > 0')
        prom.wait_for('sum(tandem_requests_total{status="400"}) > 0')
        prom.wait_for('sum(tandem_kv_transfer_seconds_count{outcome="ok"}) > 0')
        empty = []
        checked = 0
        for name, dash in dashboards().items():
            variables = _constants(dash)
            for title, expr in panel_queries(dash):
                q = grafana_expr(expr, variables)
                try:
                    prom.wait_for(q, timeout_s=20)
                    checked += 1
                except AssertionError:
                    empty.append((name, title, q, prom.query(q)))
        assert not empty, json.dumps(empty, indent=1)
        assert checked >= 30
    finally:
        if prom is not None:
            prom.stop()
        assert cluster.stop() == 0
