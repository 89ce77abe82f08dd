"""``tandem bench gateway`` end to end, briefly: real fake-backend, router (one process, then two on one port as
granian's worker processes) and load-client processes on loopback.

The backends are fakes (``bench.fake_worker``: canned tokens, no engine) because the benchmark measures the router's
own overhead only. What is checked is that the report is well formed and sane (every phase answered, every answer
8 tokens, no errors, percentiles ordered), not any timing goal: this machine's cores are shared.
"""

from __future__ import annotations

import shutil
import sys
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
    """With wrk as the client, and the router reaching its backends on the gRPC Session call (the other tests
    use the default, the backends' TCP session port)."""
    report = run_gateway_bench(seconds=1.0, concurrency=8, processes=(1,), tokens=8, ttft_concurrency=(1,),
                               model=checkpoint("llama"), wrk=True, session_transport="grpc")
    assert report["config"]["session_transport"] == "grpc"
    _phase_ok(report["direct"]["throughput"])
    _phase_ok(report["router"][0]["throughput"])
    w = report["router"][0]["wrk"]
    assert w["rps"] > 0 and w["requests"] > 0 and w["non_2xx"] == 0 and w["socket_errors"] == 0
    assert w["cpu_us_per_request"]["router"] > 0
    assert report["summary"]["router_rps_wrk"] == {"1": w["rps"]}


def test_fake_http_worker_answers_what_the_bench_checks() -> None:
    """The peer's backend (``bench.fake_http_worker``, a real process on loopback), driven by the bench's own
    client: non-streaming and streamed answers both pass the bench's answer check, and the probes a router makes
    are answered."""
    import urllib.request

    from bench.gateway import Phase, _drive
    from router.serve import ReadyProcess

    fake = ReadyProcess.start("fake-http", [sys.executable, "-m", "bench.fake_http_worker", "--port", "0",
                                            "--tokens", "8", "--model", "m", "--model-path", "/models/m"])
    try:
        batch, stream = _drive(f"http://127.0.0.1:{fake.port}", "m", 8,
                               [Phase(False, 4, 0.5, 0.1), Phase(True, 2, 0.5, 0.1)])
        for m in (batch, stream):
            _phase_ok(m)
        info = urllib.request.urlopen(f"http://127.0.0.1:{fake.port}/get_model_info", timeout=5).read()
        assert b'"model_path":"/models/m"' in info
        assert urllib.request.urlopen(f"http://127.0.0.1:{fake.port}/health", timeout=5).status == 200
    finally:
        fake.stop()


_SGLANG = Path(__file__).resolve().parent.parent / ".venv-sglang-router" / "bin" / "sglang-router"


@pytest.mark.skipif(not _SGLANG.exists(), reason="sglang-router is not installed (bench/sglang_router/install.sh)")
def test_gateway_bench_measures_sglang_router_side_by_side(checkpoint: Callable[[str], Path]) -> None:
    report = run_gateway_bench(seconds=1.0, concurrency=8, processes=(1,), tokens=8, ttft_concurrency=(1,),
                               model=checkpoint("llama"), sglang_router=str(_SGLANG))
    peer = report["peer"]
    _phase_ok(peer["throughput"])
    _phase_ok(peer["direct"]["throughput"])
    assert report["summary"]["peer"] == "sglang-router" and report["summary"]["ratio_best_router_to_peer"] > 0
    assert report["summary"]["all_answers_ok"] is True
