"""The cluster simulator (sim/): conservation on a short run with the planner, the roofline, the trace mapping,
KV-aware routing against round-robin, and the ``tandem sim`` command.

Only the model step is modelled (there is no GPU here); the router, scheduler, block pool and planner are the real
ones."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from cli.main import main
from engine.block_hash import hash_blocks
from sim.cluster import REJECTED
from sim.hardware import H100
from sim.results import gpu_seconds_by_life, gpu_seconds_by_timeline
from sim.roofline import ModelShape, StepModel
from sim.scenario import Scenario, simulate
from sim.tokens import prompt_block_hashes, token_ids
from sim.trace import SyntheticShape, TraceRequest, diurnal, load_mooncake

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def test_a_short_autoscaled_run_conserves_requests_blocks_and_gpu_time() -> None:
    # Three minutes of a diurnal load (trough, peak, trough) on a Llama-3-70B shape, TP=8 H100s, planner on.
    trace = diurnal(10.0, 180.0, trough_fraction=0.05, shape=SyntheticShape(input_mean=2048, output_mean=128))
    scn = Scenario(prefill=1, decode=1, autoscale=True, gpu_budget=64, startup_s=15.0, planner_window_s=10.0)
    cluster, r = simulate(scn, trace)
    assert r["requests"] == len(trace) > 500
    assert r["done"] + r["rejected"] == len(trace) and r["unfinished"] == 0
    assert r["rejected"] == 0 and r["failed_during_drain"] == 0
    for w in cluster.gone:  # every replica, retired at the end or drained on the way
        w.pool.check_accounting()
        assert not w.sched.has_unfinished()
    assert math.isclose(gpu_seconds_by_life(cluster), gpu_seconds_by_timeline(cluster), rel_tol=1e-9)
    assert r["gpu_hours"] > 0
    tiers_up = {e["tier"] for e in cluster.books.scale_events if e["to"] > e["from"]}
    tiers_down = {e["tier"] for e in cluster.books.scale_events if e["to"] < e["from"]}
    assert tiers_up and tiers_down, cluster.books.scale_events
    held = [(e[2] + e[3] + e[4]) * 8 for e in cluster.books.replicas]
    assert max(held) <= 64 - 8  # one tier's GPUs at most: the other always holds its minimum replica


def test_roofline_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    shape = ModelShape.from_config(Scenario().model_config(), "llama-3-70b")
    assert 69e9 < shape.active_params < 71e9 and shape.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2
    step = StepModel(shape, H100, tp=8, mfu=0.5, mbu=0.7)
    decode = step.step_time(1, 1.0, 1)
    weights_read = shape.weight_bytes / (8 * H100.mem_bandwidth * 0.7)
    assert weights_read < decode < weights_read * 1.3  # the rest is the TP all-reduces
    prefill = step.step_time(8192, 8192 * 4096.5, 8192)
    flops = 2 * shape.active_params * 8192 + 4 * 80 * 8192 * 8192 * 4096.5
    compute = flops / (8 * H100.peak_flops * 0.5)
    all_reduce = 2 * 80 * (8e-6 + 2 * 7 / 8 * 8192 * 8192 * 2 / 450e9)  # ring, two per layer
    assert prefill == pytest.approx(compute + all_reduce)
    assert step.transfer_time(10_000) == pytest.approx(10_000 * shape.kv_bytes_per_token / 400e9 + 50e-6)


def test_mooncake_hash_ids_become_shared_block_hashes_exactly_where_the_ids_are_shared() -> None:
    a = prompt_block_hashes((1, 2, 3), 1300, 16, ("model=m",))
    b = prompt_block_hashes((1, 2, 9), 1400, 16, ("model=m",))
    assert len(a) == 1300 // 16 and len(b) == 1400 // 16
    assert a[:64] == b[:64] and a[64] != b[64]  # two shared 512-token ids = 64 blocks of 16
    assert a == hash_blocks(token_ids((1, 2, 3), 1300), 16, ("model=m",))


@pytest.mark.slow
def test_kv_aware_routing_gets_more_prefix_hits_than_round_robin_on_the_mooncake_trace() -> None:
    # Two minutes of the trace's clock at 4x: its conversations come back for their next turns within it. Outputs
    # are capped at 4 tokens (the hit rate is decided at prefill) and blocks are 64 tokens, to keep the test short.
    trace = [replace(r, output_len=min(r.output_len, 4)) for r in load_mooncake(TRACE, speedup=4.0, duration_s=120)]
    rates = {}
    for routing in ("kv", "round_robin"):
        _, r = simulate(Scenario(prefill=8, decode=2, routing=routing, block_size=64), trace)
        assert r["done"] == len(trace) > 1000
        rates[routing] = r["prefix_hit_rate"]
    assert rates["kv"] > 2 * rates["round_robin"], rates


def test_tandem_sim_writes_its_result_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--synthetic", "poisson", "--rate", "2", "--duration", "20", "--prefill", "1", "--decode",
               "1", "--out", str(tmp_path), "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert printed["done"] == saved["done"] == saved["requests"] > 10
    assert (tmp_path / "replicas.png").stat().st_size > 1000 and (tmp_path / "latency.png").stat().st_size > 1000
    assert main(["sim", "--trace", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.parametrize("prefill", [1, 0])
def test_a_prompt_no_replica_can_hold_is_rejected_and_the_books_still_balance(prefill: int) -> None:
    """Disaggregated (the prefill side refuses it before any decode block is reserved) and colocated (the
    scheduler's own refusal): the 200k-token prompt is rejected, every other request is done, and every block pool
    is all-free at the end."""
    ok = [TraceRequest(0.5 * i, 3000, 8, (7000 + i,)) for i in range(6)]
    trace = [*ok[:3], TraceRequest(1.6, 200_000, 8, ()), *ok[3:]]
    trace.sort(key=lambda r: r.arrival_s)
    cluster, r = simulate(Scenario(prefill=prefill, decode=1), trace)
    assert (r["done"], r["rejected"], r["unfinished"]) == (6, 1, 0)
    huge = next(i for i, t in enumerate(trace) if t.input_len == 200_000)
    assert cluster.books.status[huge] == REJECTED and math.isnan(cluster.books.ttft[huge])
    for w in cluster.gone:
        w.pool.check_accounting()
    assert math.isclose(gpu_seconds_by_life(cluster), gpu_seconds_by_timeline(cluster), rel_tol=1e-9)
    assert r["slo_attainment"] == pytest.approx(6 / 7)  # a rejected request misses the SLO
