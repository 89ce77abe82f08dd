"""Tandem's alert rules (deploy/helm/tandem/alerts/tandem-rules.yaml): valid for ``promtool check rules``, every
alert's unit tests pass under ``promtool test rules`` (deploy/helm/tandem/hack/alerts-test.yaml: each fires on the
series that should trip it and stays quiet otherwise), every series they name is exported, and the chart wraps
the same rules in a PrometheusRule. promtool is Debian's prometheus package, which .ci/run installs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from crd_check import CHART
from test_chart import _render, chart  # noqa: F401  (the chart fixture: the chart less its kuberay dependency)

from router.metric_catalogue import exported_series

RULES = CHART / "alerts" / "tandem-rules.yaml"
UNIT_TESTS = CHART / "hack" / "alerts-test.yaml"
ALERTS = {"TandemTTFTBudgetBurn", "TandemITLBudgetBurn", "TandemHigh5xxRatio", "TandemKVTransferFailures",
          "TandemWorkerCutOff", "TandemTierBelowDesired"}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed (.ci/run installs Debian's prometheus package)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def _rules() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules() -> None:
    proc = _promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests_cover_every_alert_and_pass() -> None:
    proc = _promtool("test", "rules", str(UNIT_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = {t["alertname"] for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == ALERTS == {str(r["alert"]) for r in _rules()}


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests are not vacuous: the tier alert without its 10-minute hold fires too early and fails."""
    (tmp_path / "alerts").mkdir()
    (tmp_path / "hack").mkdir()
    (tmp_path / "alerts" / RULES.name).write_text(RULES.read_text().replace("for: 10m", "for: 1m"))
    (tmp_path / "hack" / UNIT_TESTS.name).write_text(UNIT_TESTS.read_text())
    proc = _promtool("test", "rules", str(tmp_path / "hack" / UNIT_TESTS.name))
    assert proc.returncode != 0 and "TandemTierBelowDesired" in proc.stdout + proc.stderr


def test_every_series_the_rules_name_is_exported() -> None:
    exported = exported_series()
    for rule in _rules():
        names = set(re.findall(r"\btandem_[a-z0-9_]+", str(rule["expr"])))
        assert names and names <= exported, (rule["alert"], sorted(names - exported))


def test_the_chart_wraps_the_same_rules_in_a_prometheusrule(chart: Path) -> None:  # noqa: F811
    docs = _render(chart, "-f", str(CHART / "ci" / "observability-values.yaml"))
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
