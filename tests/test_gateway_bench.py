"""``tandem bench gateway`` end to end, briefly: real fake-backend, router (one process, then two on one port through
SO_REUSEPORT) and load-client processes on loopback.

The backends are fakes (``bench.fake_worker``: canned tokens, no engine) because the benchmark measures the router's
own overhead only. What is checked is that the report is well formed and sane (every phase answered, every answer
8 tokens, no errors, percentiles ordered), not any timing goal: this machine's cores are shared.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.gateway import GOALS, run_gateway_bench

pytestmark = pytest.mark.slow


def _phase_ok(m: dict[str, Any]) -> None:
    assert m["completed"] > 0 and m["rps"] > 0
    assert m["errors"] == 0 and m["bad"] == 0
    for q in ("latency_ms", "ttft_ms"):
        assert 0 < m[q]["p50"] <= m[q]["p99"]
    assert m["ttft_ms"]["p50"] <= m["latency_ms"]["p99"]


def test_gateway_bench_reports_sane_figures_for_direct_and_one_and_two_router_processes(
        checkpoint: Callable[[str], Path]) -> None:
    report = run_gateway_bench(seconds=1.0, concurrency=8, processes=(1, 2), tokens=8, ttft_concurrency=(1,),
                               model=checkpoint("llama"))
    assert report["config"]["cpu_count"] >= 1 and report["config"]["tokens"] == 8
    assert report["goals"] == GOALS
    direct = report["direct"]
    _phase_ok(direct["throughput"])
    _phase_ok(direct["ttft"]["1"])
    assert direct["cpu_us_per_request"]["backends"] > 0 and direct["cpu_us_per_request"]["client"] > 0
    assert [r["processes"] for r in report["router"]] == [1, 2]
    for r in report["router"]:
        _phase_ok(r["throughput"])
        _phase_ok(r["ttft"]["1"])
        assert r["rps"] == r["throughput"]["rps"] and r["ratio_to_direct"] > 0
        assert r["cpu_us_per_request"]["router"] > 0
        added = r["added_ttft_ms"]["1"]
        assert added["p50"] == pytest.approx(r["ttft"]["1"]["ttft_ms"]["p50"] - direct["ttft"]["1"]["ttft_ms"]["p50"],
                                             abs=1e-3)
    assert direct["generate_calls_rps"] > 0  # the per-call reference next to the session figure
    summary = report["summary"]
    assert summary["all_answers_ok"] is True
    assert set(summary["router_rps"]) == {"1", "2"} and summary["direct_rps"] == direct["rps"]


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (.ci/run installs it)")
def test_gateway_bench_with_wrk_reports_its_requests_and_the_routers_cpu(checkpoint: Callable[[str], Path]) -> None:
    report = run_gateway_bench(seconds=1.0, concurrency=8, processes=(1,), tokens=8, ttft_concurrency=(1,),
                               model=checkpoint("llama"), wrk=True)
    w = report["router"][0]["wrk"]
    assert w["rps"] > 0 and w["requests"] > 0 and w["non_2xx"] == 0 and w["socket_errors"] == 0
    assert w["cpu_us_per_request"]["router"] > 0
    assert report["summary"]["router_rps_wrk"] == {"1": w["rps"]}
