"""`tandem bench kv`: its bandwidth phase end to end (real child processes on loopback) and its text report.

Only the report's shape and consistency are asserted: bandwidth goals live in docs/benchmarks.md, never in tests.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kv import format_kv_report

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kv_bench_cli_reports_the_backend_beside_its_baselines() -> None:
    """One 1 MiB size over tcp: the tcp backend between two processes, a raw socket, memcpy and (when NIXL is
    installed) both raw NIXL references, each a positive bandwidth, with the ratios computed from them."""
    cmd = [sys.executable, "-m", "cli.main", "bench", "kv", "--sizes", "1", "--backends", "tcp", "--repeats", "1",
           "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    bw = report["bandwidth"]
    row = bw["gbps"]["1"]
    names = ["memcpy", "raw_socket", "tcp"]
    if importlib.util.find_spec("nixl") is not None:
        names += ["raw_nixl", "raw_nixl_no_progress_thread", "raw_nixl_acked"]
    for name in names:
        assert 0 < row[name] < float("inf"), (name, row)
    assert "torch" not in row and "raw_gloo" not in row  # only what --backends asks for, and its baselines
    ratios = bw["ratios"]["1"]
    assert ratios["tcp/raw_socket"] == pytest.approx(row["tcp"] / row["raw_socket"])
    if "raw_nixl" in row:  # the carrier's own ceiling against NIXL, from the same run
        assert ratios["raw_socket/raw_nixl"] == pytest.approx(row["raw_socket"] / row["raw_nixl"])
    assert bw["repeats_per_size"] == {"1": 64}  # 64 requests of 1 MiB however small --repeats is
    assert "overlap" not in report and "decode_itl" not in report  # no --model: the bandwidth phase only

    text = format_kv_report(report)
    assert f"{row['tcp']:.2f}" in text and f"tcp/raw_socket={ratios['tcp/raw_socket']:.2f}" in text


def test_kv_bench_text_report_gives_every_phase_next_to_its_goal() -> None:
    """Without --json the bench prints the bandwidth table, then per backend the overlap median with its runs and
    the decode ITL quiet / control / loaded with the transfer cost, each section naming its goal."""
    itl = {"p50": 30.0, "p99": 40.0}
    report = {
        "bandwidth": {"gbps": {1: {"memcpy": 50.0, "raw_socket": 2.0, "raw_nixl": None, "tcp": 1.5}},
                      "ratios": {1: {"tcp/raw_socket": 0.75}}},
        "overlap": [{"backend": "tcp", "prompt_len": 2048, "kv_bytes": 64 << 20, "overlap": 0.9,
                     "serial_transfer_s": 0.02, "exposed_after_compute_s": 0.002,
                     "runs": [{"overlap": 0.85}, {"overlap": 0.9}, {"overlap": 0.95}]}],
        "decode_itl": [{"backend": "tcp", "kv_io": "spare", "itl_ms_quiet": itl, "itl_ms_prefill_compute_only": itl,
                        "itl_ms_with_transfers": {"p50": 33.0, "p99": 60.0}, "transfer_cost_p50": 0.1,
                        "transfer_cost_p50_runs": [0.05, 0.1, 0.2], "transfers_during_loaded_run": 30}],
    }
    text = format_kv_report(report)
    lines = text.splitlines()
    assert ">= 0.90 of raw NIXL" in lines[0]
    assert lines[2].split() == ["1", "50.00", "2.00", "-", "1.50"]  # a missing baseline prints as "-"
    assert "tcp/raw_socket=0.75" in text
    overlap = next(line for line in lines if line.strip().startswith("tcp:") and "median" in line)
    assert "90.0% median (85.0, 90.0, 95.0)" in overlap and "serial 20.0 ms" in overlap
    assert "64 MiB of KV for 2048 tokens" in overlap
    decode = next(line for line in lines if "quiet" in line)
    assert "with transfers 33.0 / 60.0" in decode and "cost +10.0% p50 (+5.0, +10.0, +20.0)" in decode
    assert "30 transfers" in decode and "tcp, KV I/O on a spare CPU: quiet 30.0" in decode
    assert "goal >= 80%" in text and "unaffected while transfers land" in text


def test_itl_phase_refuses_an_unknown_kv_io_placement_before_starting_workers() -> None:
    from bench.kv import measure_itl

    with pytest.raises(ValueError, match="kv_io must be one of"):
        measure_itl("/nonexistent", "tcp", 16, kv_io="gpu")
