"""PNG plots of a run: replicas per tier over time, and TTFT / inter-token latency over time against the SLOs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.cluster import Cluster


def plot(cluster: Cluster, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for tier in (t.name for t in cluster.cfg.tiers):
        pts = [(t, r + s + d, r) for t, name, r, s, d in cluster.books.replicas if name == tier]
        if pts:
            ts, held, ready = zip(*pts, strict=True)
            ax.step([*ts, cluster.end_s], [*held, held[-1]], where="post", label=f"{tier} (held)")
            ax.step([*ts, cluster.end_s], [*ready, ready[-1]], where="post", linestyle="--", label=f"{tier} (ready)")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "replicas.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    arrivals = np.array([r.arrival_s for r in cluster.trace])
    ttft = np.asarray(cluster.books.ttft)
    a1.scatter(arrivals + np.nan_to_num(ttft), ttft, s=2)
    a1.axhline(cluster.cfg.ttft_slo_s, color="red", linewidth=1)
    a1.set_ylabel("TTFT (s)")
    a1.set_yscale("log")
    itl_at, itl = np.asarray(cluster.books.itl_at), np.asarray(cluster.books.itl)
    if len(itl):
        step = max(len(itl) // 20000, 1)
        a2.scatter(itl_at[::step], itl[::step], s=1)
    a2.axhline(cluster.cfg.itl_slo_s, color="red", linewidth=1)
    a2.set_ylabel("inter-token (s)")
    a2.set_yscale("log")
    a2.set_xlabel("simulated time (s)")
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
