"""``tandem bench parallel`` on the tiny model: TP=2's ranks each hold half of the sharded weights, produce TP=1's
tokens, and report their all-reduce share of a step (real rank processes; speed is not asserted)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.parallel import add_parallel_args, format_report, run_from_args


@pytest.mark.slow
def test_bench_parallel_reports_half_the_weights_per_rank_and_tp1s_tokens(checkpoint: Callable[[str], Path]) -> None:
    parser = argparse.ArgumentParser()
    add_parallel_args(parser)
    args = parser.parse_args(["--model", str(checkpoint("llama")), "--num-prompts", "2", "--input-len", "8",
                              "--output-len", "4", "--single-len", "4", "--repeats", "1", "--num-kv-blocks", "32"])
    report = run_from_args(args)
    one, two = report["results"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert two["same_tokens_as_tp1"] is True
    assert len(two["weights_mb"]) == 2
    # the embedding, head and every linear split in two; only the norms are replicated
    assert all(0.49 < w / one["weights_mb"][0] < 0.52 for w in two["weights_mb"])
    assert one["allreduce_fraction"] == [0.0]
    assert all(0.0 < f < 1.0 for f in two["allreduce_fraction"])
    assert all(c > 0 for c in two["allreduce_calls_per_step"])
    assert "TP=2" in format_report(report)


@pytest.mark.slow
def test_bench_parallel_compares_ep_dispatches_on_a_moe_model(checkpoint: Callable[[str], Path]) -> None:
    parser = argparse.ArgumentParser()
    add_parallel_args(parser)
    args = parser.parse_args(["--model", str(checkpoint("mixtral")), "--tp", "1", "--ep", "2",
                              "--ep-dispatch", "all_gather,all_to_all", "--num-prompts", "2", "--input-len", "8",
                              "--output-len", "4", "--single-len", "4", "--repeats", "1", "--num-kv-blocks", "32"])
    report = run_from_args(args)
    gather, a2a = report["results"]
    assert [(r["tp"], r["ep"], r["ep_dispatch"]) for r in report["results"]] == [(1, 2, "all_gather"),
                                                                                 (1, 2, "all_to_all")]
    assert a2a["same_tokens_as_tp1"] is True  # both exchanges are exact: the same greedy tokens
    for r in (gather, a2a):
        assert r["allreduce_fraction"] == [0.0, 0.0]  # attention replicated, MoE by the exchange: no all-reduce
        assert all(0.0 < f < 1.0 for f in r["exchange_fraction"])
        assert r["weights_mb"][0] == r["weights_mb"][1]
    assert "EP=2 all_to_all" in format_report(report)
