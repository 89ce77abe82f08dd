"""The simulator's inputs and its sweep: Mooncake-format replay at a speed-up, the three synthetic generators,
``tandem sim --trace FILE --model CONFIG --gpu h200 --autoscale --speedup X --json``, and goodput at >= 90%
attainment over speed-ups (the measure the disaggregated-against-colocated result uses).

Only the model step is modelled (there is no GPU here); the router, scheduler, block pool and planner are the real
ones."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from cli.main import main
from sim.scenario import DEFAULT_MODEL, Scenario
from sim.sweep import SweepRow, goodput, sweep
from sim.trace import SyntheticShape, bursty, diurnal, load_mooncake, poisson, write_mooncake

SHORT = SyntheticShape(input_mean=1024, output_mean=16, seed=3)


def _counts(trace: list, window_s: float, duration_s: float) -> list[int]:
    counts = [0] * math.ceil(duration_s / window_s)
    for r in trace:
        counts[int(r.arrival_s // window_s)] += 1
    return counts


def test_mooncake_replay_divides_the_clock_by_the_speedup_and_cuts_at_duration_and_limit(tmp_path: Path) -> None:
    trace = poisson(2.0, 60.0, shape=SHORT)
    path = tmp_path / "trace.jsonl"
    write_mooncake(trace, path)
    same = load_mooncake(path)
    assert [(r.input_len, r.output_len, r.hash_ids) for r in same] == [
        (r.input_len, r.output_len, r.hash_ids) for r in trace]
    fast = load_mooncake(path, speedup=4.0)
    assert len(fast) == len(trace) and all(
        f.arrival_s == pytest.approx(round(r.arrival_s * 1000) / 4000) for f, r in zip(fast, trace, strict=True))
    assert max(r.arrival_s for r in load_mooncake(path, speedup=4.0, duration_s=5.0)) <= 5.0
    assert len(load_mooncake(path, speedup=4.0, duration_s=5.0)) == sum(r.arrival_s <= 5.0 for r in fast)
    assert len(load_mooncake(path, limit=7)) == 7
    with pytest.raises(ValueError, match="speedup"):
        load_mooncake(path, speedup=0)


def test_poisson_keeps_its_rate_with_exponential_gaps() -> None:
    trace = poisson(20.0, 300.0, shape=SHORT)
    assert abs(len(trace) - 6000) < 4 * math.sqrt(6000)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: stdev = mean
    # every request opens with one of the shared system prompts, then ids of its own
    assert all(r.hash_ids[0] in {1 + i * 1000 for i in range(SHORT.num_system_prompts)} for r in trace)


def test_bursty_keeps_its_mean_rate_but_is_far_more_dispersed_than_poisson() -> None:
    rate, duration = 10.0, 3000.0
    trace = bursty(rate, duration, burst_factor=5.0, mean_period_s=60.0, shape=SHORT)
    assert len(trace) / duration == pytest.approx(rate, rel=0.2)
    counts, steady = _counts(trace, 10.0, duration), _counts(poisson(rate, duration, shape=SHORT), 10.0, duration)
    dispersion = statistics.variance(counts) / statistics.mean(counts)  # 1 for a Poisson process
    assert statistics.variance(steady) / statistics.mean(steady) < 1.5 < 3 < dispersion
    assert max(counts) > 3 * rate * 10  # bursts at ~5x the calm rate


def test_diurnal_goes_from_its_trough_to_its_peak_and_back() -> None:
    peak, duration = 40.0, 600.0
    trace = diurnal(peak, duration, trough_fraction=0.2, shape=SHORT)
    counts = _counts(trace, 60.0, duration)
    assert counts[0] / 60 < 0.4 * peak and counts[-1] / 60 < 0.4 * peak  # near 20% of the peak at both ends
    assert max(counts[4:6]) / 60 == pytest.approx(peak, rel=0.15)  # the peak mid-period
    assert counts.index(max(counts)) in (4, 5)


def test_tandem_sim_replays_a_trace_file_on_h200_with_the_planner(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    trace = poisson(1.0, 40.0, shape=SHORT)
    write_mooncake(trace, path)
    rc = main(["sim", "--trace", str(path), "--model", str(Path(DEFAULT_MODEL) / "config.json"), "--gpu", "h200",
               "--prefill", "1", "--decode", "1", "--autoscale", "--speedup", "2", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["config"]["gpu"] == "h200" and r["config"]["autoscale"] is True
    assert r["config"]["model"] == "llama-3-70b" and r["config"]["tiers"]["prefill"]["replicas"] == 1
    assert r["requests"] == r["done"] == len(trace)
    assert r["trace_duration_s"] == pytest.approx(max(round(t.arrival_s * 1000) for t in trace) / 2000)
    for key in ("slo_attainment", "goodput_rps", "gpu_hours", "prefix_hit_rate", "ttft_s", "itl_s", "tpot_s",
                "replicas", "scale_events", "failed_during_drain"):
        assert key in r, key
    assert {e["tier"] for e in r["replicas"]} == {"prefill", "decode"}
    assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
    # bad input: a clear error and exit code 2
    assert main(["sim", "--trace", str(path), "--gpu", "h100", "--speedup", "0"]) == 2
    assert "speedup must be > 0" in capsys.readouterr().err
    assert main(["sim", "--trace", str(path), "--model", str(tmp_path / "nowhere")]) == 2


def test_goodput_is_the_fastest_run_at_or_above_90_percent_attainment(tmp_path: Path) -> None:
    """One replica pair, the same 60 requests replayed 1x and 200x faster: the slow replay meets the SLO, the fast
    one cannot (every request arrives within a third of a second), so goodput is the 1x rate."""
    path = tmp_path / "trace.jsonl"
    write_mooncake(poisson(1.0, 60.0, shape=SHORT), path)
    seen: list[SweepRow] = []
    rows = sweep(Scenario(prefill=1, decode=1, ttft_slo_s=1.0), lambda x: load_mooncake(path, x), [1.0, 200.0],
                 seen.append)
    assert seen == rows and [r.speedup for r in rows] == [1.0, 200.0]
    assert rows[0].attainment >= 0.9 > rows[1].attainment
    assert rows[1].rate_rps == pytest.approx(200 * rows[0].rate_rps)
    assert rows[0].rate_per_gpu == pytest.approx(rows[0].rate_rps / 16)
    best = goodput(rows)
    assert best is rows[0] and goodput(rows, attainment=1.01) is None
    with pytest.raises(ValueError, match="speed-ups must be > 0"):
        sweep(Scenario(), lambda x: load_mooncake(path, x), [0.0])
