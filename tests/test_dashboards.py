"""The Grafana dashboards (deploy/helm/tandem/dashboards/): the committed JSON is what the generator writes (as
``python -m proto.generate --check``), every panel queries only metrics in router/metric_catalogue.py, and the chart
packages each as a ConfigMap with the Grafana sidecar's label (rendered by the real helm binary)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from crd_check import CHART
from test_chart import _render, chart  # noqa: F401  (the chart fixture: the chart less its kuberay dependency)

from router.metric_catalogue import exported_series

GENERATOR = CHART / "hack" / "dashboards.py"
NAMES = re.compile(r"\b(?:tandem_[a-z0-9_]+|vllm:[a-z0-9_]+)")


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def panel_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_committed_dashboards_are_what_the_generator_writes() -> None:
    proc = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_four_dashboards_each_panel_with_queries_naming_only_exported_metrics() -> None:
    dash = dashboards()
    assert sorted(dash) == ["kv-transfer", "overview", "router", "tiers"]
    exported = exported_series()
    for name, d in dash.items():
        assert d["uid"] == f"tandem-{name}" and d["panels"], name
        for panel in d["panels"]:
            assert panel["targets"], (name, panel["title"])
        for title, expr in panel_queries(d):
            names = NAMES.findall(expr)
            if re.fullmatch(r"vector\(\$[a-z_]+\)", expr):  # an SLO target line (a dashboard constant)
                continue
            assert names, (name, title, expr)
            assert set(names) <= exported, (name, title, sorted(set(names) - exported))


def test_the_chart_packages_each_dashboard_as_a_sidecar_configmap(chart: Path) -> None:  # noqa: F811
    docs = _render(chart, "-f", str(CHART / "ci" / "observability-values.yaml"))
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert sorted(maps) == [f"tandem-operator-dashboard-{n}" for n in ("kv-transfer", "overview", "router", "tiers")]
    for name, dash in dashboards().items():
        cm = maps[f"tandem-operator-dashboard-{name}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Tandem"}
        assert json.loads(cm["data"][f"tandem-{name}.json"]) == dash
    assert not [d for d in _render(chart) if d["kind"] in ("ConfigMap", "PrometheusRule")]  # off by default
