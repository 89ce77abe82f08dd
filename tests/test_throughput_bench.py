"""`tandem bench throughput` end to end on the tiny checkpoint, Tandem and transformers side by side.

Only the report's shape and the greedy agreement are asserted: speed goals live in the benchmark's figures
(docs/benchmarks.md), never in tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.mark.slow
def test_throughput_bench_reports_both_sides(checkpoint: Callable[[str], Path]) -> None:
    cmd = [sys.executable, "-m", "cli.main", "bench", "throughput", "--model", str(checkpoint("llama")),
           "--num-prompts", "3", "--input-len", "12", "--output-len", "5", "--repeats", "2", "--single", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    tandem, hf = report["sides"]["tandem"], report["sides"]["transformers"]
    for side in (tandem, hf):
        assert side["tokens_per_s"] > 0 and side["peak_rss_mb"] > 0
        assert side["num_output_tokens"] == 15
        assert len(side["tokens_per_s_runs"]) == 2
    assert report["tokens_per_s"] == tandem["tokens_per_s"]
    assert report["peer_tokens_per_s"] == hf["tokens_per_s"]
    assert report["ratio"] == pytest.approx(tandem["tokens_per_s"] / hf["tokens_per_s"])
    assert hf["agree_with_tandem"] == 1.0  # greedy fp32: the same tokens on every prompt
    assert tandem["single_decode_tokens_per_s"] > 0
