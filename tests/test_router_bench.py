"""``tandem bench router`` (bench/router.py) end to end on a small index: every phase runs, within its bounds, and
reports figures that are consistent with the index it built."""

from __future__ import annotations

from bench.router import run_router_bench


def test_router_bench_reports_every_phase_on_a_small_full_index() -> None:
    out = run_router_bench(workers=(8, 32), cached_blocks=20_000, request_blocks=16, seconds=0.05,
                           churn_events=5_000, seed=3)
    assert out["config"]["cached_blocks"] == 20_000
    assert [r["workers"] for r in out["results"]] == [8, 32]
    for r in out["results"]:
        assert r["entries"] <= 20_000 and r["distinct_hashes"] <= r["entries"]
        for key in ("match_per_s", "match_per_s_hot_working_set", "match_depths_per_s"):
            assert r[key] > 0, key
        assert 0 < r["match_avg_hit_workers"] <= r["workers"]
        assert 0 < r["match_avg_best_blocks"] <= 16
        for key in ("decide_hashed", "decide_with_hashing"):
            d = r[key]
            assert d["per_s"] > 0 and d["calls"] > 0 and 0 < d["p50_us"] <= d["p99_us"], key
        assert r["churn_published_blocks"] >= 5_000 and r["evictions"] > 0  # the full index evicted to stay bounded
