"""``tandem bench serve``'s report: its CPU accounting (bench/serve_cpu.py) against real processes, and one real
colocated ``tandem up`` side with a tiny load. The fields and their arithmetic are checked, never a timing goal."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.serve import ServeConfig, format_report, run_serve_bench
from bench.serve_cpu import CpuMeter, cpu_report

# A "worker": its engine-loop thread (named in the OS as the gRPC server's start names it) burns 0.3 s of its own
# CPU per line on stdin, then says so.
_WORKER = """
import sys, threading, time
from worker.aio_server import name_threads_in_os
go, done = threading.Event(), threading.Event()
def engine():
    while True:
        go.wait(); go.clear()
        t = time.thread_time()
        while time.thread_time() - t < 0.3:
            pass
        done.set()
threading.Thread(target=engine, name="engine-loop", daemon=True).start()
name_threads_in_os()
print("ready", flush=True)
for _ in sys.stdin:
    go.set(); done.wait(); done.clear()
    print("burnt", flush=True)
"""
# The "tandem up" process: a session leader that starts the worker, prints its PID and waits.
_ROUTER = f"""
import subprocess, sys
w = subprocess.Popen([sys.executable, "-c", {_WORKER!r}, "--role", "decode"], stdin=sys.stdin, stdout=sys.stdout)
print(w.pid, flush=True)
w.wait()
"""


def test_cpu_meter_splits_a_workers_engine_thread_from_the_rest(tmp_path: Path) -> None:
    """Processes are found through the state file and named by --role; CPU the engine-loop thread burns between
    two samples is counted as the worker's engine time, within its process total; per-token figures divide by
    the tokens given."""
    router = subprocess.Popen([sys.executable, "-c", _ROUTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert router.stdout is not None and router.stdin is not None
        worker_pid = int(router.stdout.readline())
        assert router.stdout.readline().strip() == "ready"
        state = tmp_path / "up.json"
        state.write_text(json.dumps({"pid": router.pid, "worker_pids": [worker_pid]}))
        meter = CpuMeter(state)
        assert meter.workers == {"decode": worker_pid}
        before = meter.sample()
        router.stdin.write("go\n")
        router.stdin.flush()
        assert router.stdout.readline().strip() == "burnt"
        after = meter.sample()
    finally:
        router.kill()
        router.wait(10)
    report = cpu_report(before, after, output_tokens=100, client_cpu_s=0.5)
    json.dumps(report)
    assert set(report["processes"]) == {"router", "decode", "ray"}
    decode = report["processes"]["decode"]
    assert decode["engine_s"] >= 0.25  # 0.3 s burnt, counted in clock ticks
    assert decode["engine_s"] <= decode["cpu_s"]
    assert decode["overhead_s"] == pytest.approx(decode["cpu_s"] - decode["engine_s"], abs=0.002)
    assert decode["engine_us_per_token"] == pytest.approx(decode["engine_s"] / 100 * 1e6, rel=0.01)
    assert "engine_s" not in report["processes"]["router"]
    total = report["total"]
    assert total["cpu_s"] == pytest.approx(sum(r["cpu_s"] for r in report["processes"].values()), abs=0.005)
    assert total["engine_s"] == decode["engine_s"]
    assert report["client"] == {"cpu_s": 0.5, "us_per_token": 5000.0}


def test_serve_bench_refuses_an_unknown_side(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown sides \\['gpu'\\]"):
        run_serve_bench(tmp_path, ServeConfig(), None, ("colocated", "gpu"))
    with pytest.raises(ValueError, match="no side"):
        run_serve_bench(tmp_path, ServeConfig(), None, ())


@pytest.mark.slow
def test_serve_bench_colocated_side_reports_cpu_per_token_by_process(checkpoint: Callable[[str], Path]) -> None:
    """One real ``tandem up --prefill 0`` under 16 requests: every request streams its tokens, and the report
    carries the CPU its router, its worker (engine loop apart) and Ray's processes spent on them. /proc counts CPU in
    10 ms ticks: 4 requests of 4 tokens once cost the router less than one tick (CI read 0.0), so the load is 16 x 8."""
    cfg = ServeConfig(concurrency=4, num_requests=16, input_len=8, output_len=8, warmup=1)
    report = run_serve_bench(checkpoint("llama"), cfg, None, ("colocated",))
    json.dumps(report)
    assert report["vllm_cpu"] == "skipped: not in --sides"
    side = report["sides"]["tandem colocated"]
    assert side["failed"] == 0 and side["output_tokens"] == 128, side
    cpu = side["cpu"]
    assert cpu["output_tokens"] == 128
    assert set(cpu["processes"]) == {"router", "decode", "ray"}
    worker = cpu["processes"]["decode"]
    assert 0 < worker["engine_s"] <= worker["cpu_s"]  # the engine loop ran the requests' steps
    assert cpu["processes"]["router"]["cpu_s"] > 0
    for key in ("us_per_token", "engine_us_per_token", "overhead_us_per_token", "cores_busy"):
        assert key in cpu["total"]
    text = format_report(report)
    assert "tandem colocated: CPU per output token" in text and "  decode: " in text
