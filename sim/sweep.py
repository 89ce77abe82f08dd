"""Goodput as DistServe reports it: the highest request rate at which SLO attainment stays at or above a target
(90%), found by replaying one trace at several speed-ups through the same fleet.

Each speed-up is a full simulation (``scenario.simulate``); the rate of a run is its requests over the replayed
trace's duration. The answer is a grid point, so the goodput lies between it and the next speed-up tried.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sim.scenario import Scenario, simulate
from sim.trace import TraceRequest


@dataclass(slots=True, frozen=True)
class SweepRow:
    speedup: float
    rate_rps: float
    rate_per_gpu: float
    attainment: float
    goodput_rps: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    wall_s: float


def sweep(scn: Scenario, load: Callable[[float], list[TraceRequest]], speedups: Iterable[float],
          on_row: Callable[[SweepRow], None] | None = None) -> list[SweepRow]:
    """One simulation of ``load(x)`` per speed-up ``x``, in the order given."""
    rows = []
    for x in speedups:
        if not x > 0:
            raise ValueError(f"speed-ups must be > 0, got {x}")
        trace = load(x)
        if not trace:
            raise ValueError(f"the trace is empty at speed-up {x:g}")
        _, r = simulate(scn, trace)
        rate = len(trace) / r["trace_duration_s"]
        gpus = sum(t["replicas"] for t in r["config"]["tiers"].values()) * r["config"]["tp"]
        row = SweepRow(x, rate, rate / gpus, r["slo_attainment"], r["goodput_rps"], r["ttft_s"]["p90"],
                       r["tpot_s"]["p90"], r["wall_s"])
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def goodput(rows: Iterable[SweepRow], attainment: float = 0.9) -> SweepRow | None:
    """The fastest run whose attainment is at least ``attainment`` (None: no run met it)."""
    ok = [r for r in rows if r.attainment >= attainment]
    return max(ok, key=lambda r: r.rate_rps) if ok else None
