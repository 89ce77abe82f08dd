"""``bench/kv_cpu.py`` (issue 32): per-request CPU, run-queue wait and time slices of real transfers between two
processes, next to a raw socket moving the same bytes."""

from __future__ import annotations

import math
import os

import pytest

from bench.kv_cpu import format_cpu_bench, run_cpu_bench, schedstat


def test_schedstat_counts_this_process_cpu() -> None:
    before = schedstat(os.getpid())
    sum(i * i for i in range(200_000))  # some CPU on this thread
    after = schedstat(os.getpid())
    assert after[0] > before[0] and after[2] >= before[2]


@pytest.mark.timeout(180)
def test_cpu_bench_reports_both_sides_of_tcp_and_the_raw_socket() -> None:
    result = run_cpu_bench([1], ["tcp"], 4, {"native_io": True})
    row = result["rows"][1]
    assert set(row) == {"raw_socket", "tcp"}
    for name, m in row.items():
        assert m["bytes"] == 1 << 20, name
        assert 0 < m["wall_ms"] < 10_000, name
        for side in ("sender", "receiver"):
            assert m[side]["cpu_ms"] > 0 and m[side]["slices"] > 0, (name, side)
            assert math.isfinite(m[side]["runq_wait_ms"]), (name, side)
    text = format_cpu_bench(result)
    assert "raw_socket" in text and "tcp" in text
