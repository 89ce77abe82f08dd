"""A run's figures: SLO attainment, goodput, GPU-hours, TTFT/ITL distributions, replicas over time, prefix hits.

A request meets the SLO when its TTFT is within ``ttft_slo_s`` and its mean inter-token latency (TPOT, DistServe's
per-request decode SLO) within ``itl_slo_s``; a rejected request misses it. Goodput is SLO-meeting requests per second
of the trace (DistServe reports the highest rate at which attainment stays >= 90%: ``sim/sweep.py`` finds that).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sim.cluster import DONE, REJECTED, Cluster


def _dist(values: np.ndarray) -> dict[str, float | None]:
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(values.max())}


def gpu_seconds_by_life(cluster: Cluster) -> float:
    return sum((w.gone_s - w.created_s) * w.gpus for w in cluster.gone)


def gpu_seconds_by_timeline(cluster: Cluster) -> float:
    """The per-tier replica timeline integrated over the run: must equal ``gpu_seconds_by_life``."""
    gpus = cluster.cfg.step.tp
    total = 0.0
    last: dict[str, tuple[float, int]] = {}
    for t, tier, ready, starting, draining in cluster.books.replicas:
        if tier in last:
            t0, n = last[tier]
            total += (t - t0) * n * gpus
        last[tier] = (t, ready + starting + draining)
    return total


def summarize(cluster: Cluster, wall_s: float | None = None) -> dict[str, Any]:
    cfg, b = cluster.cfg, cluster.books
    status = np.frombuffer(bytes(b.status), dtype=np.uint8)
    ttft = np.asarray(b.ttft)
    tpot = np.asarray(b.tpot)
    done = status == DONE
    met = done & (ttft <= cfg.ttft_slo_s) & (tpot <= cfg.itl_slo_s)
    n = len(status)
    duration = max((r.arrival_s for r in cluster.trace), default=0.0) or cluster.end_s or 1.0
    gpu_s = gpu_seconds_by_life(cluster)
    out: dict[str, Any] = {
        "requests": n,
        "done": int(done.sum()),
        "rejected": int((status == REJECTED).sum()),
        "unfinished": int(n - done.sum() - (status == REJECTED).sum()),
        "slo": {"ttft_s": cfg.ttft_slo_s, "itl_s": cfg.itl_slo_s},
        "slo_attainment": float(met.sum() / n) if n else math.nan,
        "goodput_rps": float(met.sum() / duration),
        "throughput_rps": float(done.sum() / duration),
        "trace_duration_s": duration,
        "simulated_s": cluster.end_s,
        "gpu_hours": gpu_s / 3600.0,
        "gpu_hours_by_timeline": gpu_seconds_by_timeline(cluster) / 3600.0,
        "ttft_s": _dist(ttft[done]),
        "tpot_s": _dist(tpot[done]),
        "itl_s": _dist(np.asarray(b.itl)),
        "prefix_hit_rate": b.cached_tokens / b.prompt_tokens if b.prompt_tokens else 0.0,
        "preemptions": b.preemptions,
        "scale_events": len(b.scale_events),
        "failed_during_drain": b.failed_during_drain,
        "replicas": [{"t": t, "tier": tier, "ready": r, "starting": s, "draining": d}
                     for t, tier, r, s, d in b.replicas],
        "config": {"gpu": cfg.step.gpu.name, "tp": cfg.step.tp, "mfu": cfg.step.mfu, "mbu": cfg.step.mbu,
                   "model": cfg.model_name, "routing": cfg.routing, "block_size": cfg.block_size,
                   "tiers": {t.name: {"role": t.role.value, "replicas": t.replicas} for t in cfg.tiers},
                   "autoscale": cfg.planner is not None},
    }
    if wall_s is not None:
        out["wall_s"] = wall_s
    return out
