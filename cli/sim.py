"""``tandem sim``: replay a trace (or a synthetic load) through the cluster simulator and print its figures.

Exit codes: 0 success, 2 bad input (unreadable trace, bad model config, bad flags).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any


def add_sim_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format jsonl (timestamp ms, input_length, output_length, hash_ids)")
    src.add_argument("--synthetic", choices=["poisson", "bursty", "diurnal"], help="generate the load instead")
    p.add_argument("--rate", type=float, default=5.0, help="synthetic: mean (diurnal: peak) requests/s")
    p.add_argument("--duration", type=float, default=None, help="seconds of (replayed) trace to run")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests of the trace")
    p.add_argument("--speedup", type=float, default=1.0, help="replay the trace this many times faster")
    p.add_argument("--model", default=None, help="HF config.json (or its dir); default: the shipped Llama-3-70B shape")
    p.add_argument("--gpu", default="h100", choices=["h100", "h200"])
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--prefill", type=int, default=1, help="prefill replicas (0: a colocated fleet)")
    p.add_argument("--decode", type=int, default=1, help="decode replicas (colocated ones when --prefill 0)")
    p.add_argument("--autoscale", action="store_true", help="run the SLO planner (operators/planner)")
    p.add_argument("--gpu-budget", type=int, default=None, help="planner GPU budget (default: the starting fleet)")
    p.add_argument("--target-utilisation", type=float, default=0.8,
                   help="planner: plan each tier at this fraction of its capacity at the SLO")
    p.add_argument("--routing", default="kv", choices=["kv", "round_robin"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--mbu", type=float, default=0.7)
    p.add_argument("--startup-s", type=float, default=120.0)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--itl-slo", type=float, default=0.1)
    p.add_argument("--sweep-speedups", default=None, metavar="X,Y,...",
                   help="run the trace at each speed-up and report goodput: the highest request rate whose SLO "
                        "attainment is >= 90%% (DistServe's measure)")
    p.add_argument("--out", default=None, help="directory for result.json and the PNG plots")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")


def run_sim(args: argparse.Namespace) -> int:
    from sim.plots import plot
    from sim.scenario import DEFAULT_MODEL, Scenario, simulate
    from sim.trace import SyntheticShape, bursty, diurnal, load_mooncake, poisson

    try:
        scn = Scenario(model=args.model or DEFAULT_MODEL, gpu=args.gpu, tp=args.tp, prefill=args.prefill,
                       decode=args.decode, autoscale=args.autoscale, gpu_budget=args.gpu_budget, mfu=args.mfu,
                       mbu=args.mbu, startup_s=args.startup_s, block_size=args.block_size, routing=args.routing,
                       ttft_slo_s=args.ttft_slo, itl_slo_s=args.itl_slo,
                       target_utilisation=args.target_utilisation)
        scn.model_config()
        if args.trace:
            trace = load_mooncake(args.trace, args.speedup, args.duration, args.limit)
        else:
            duration = args.duration or 600.0
            shape = SyntheticShape()
            if args.synthetic == "poisson":
                trace = poisson(args.rate, duration, shape=shape)
            elif args.synthetic == "bursty":
                trace = bursty(args.rate, duration, shape=shape)
            else:
                trace = diurnal(args.rate, duration, shape=shape)
            if args.limit is not None:
                trace = trace[:args.limit]
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.sweep_speedups:
        return _sweep(args, scn)
    cluster, result = simulate(scn, trace)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
        result["plots"] = [str(p) for p in plot(cluster, out)]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_summary(result)
    return 0


def _sweep(args: argparse.Namespace, scn: Any) -> int:
    from dataclasses import asdict

    from sim.sweep import SweepRow, goodput, sweep
    from sim.trace import load_mooncake

    if not args.trace:
        print("error: --sweep-speedups needs --trace", file=sys.stderr)
        return 2

    def show(row: SweepRow) -> None:
        if not args.json:
            print(f"speedup {row.speedup:g}: {row.rate_rps:.2f} req/s ({row.rate_per_gpu:.4f}/GPU), attainment "
                  f"{row.attainment:.1%}, TTFT p90 {_num(row.ttft_p90_s, 2)} s, TPOT p90 {_num(row.tpot_p90_s, 3)} s",
                  flush=True)

    try:
        speedups = [float(v) for v in args.sweep_speedups.split(",")]
        rows = sweep(scn, lambda x: load_mooncake(args.trace, x, args.duration, args.limit), speedups, show)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = goodput(rows)
    summary = {"runs": [asdict(r) for r in rows], "goodput_rps_at_90": best.rate_rps if best else 0.0,
               "goodput_per_gpu_at_90": best.rate_per_gpu if best else 0.0}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"goodput at >= 90% attainment: {summary['goodput_rps_at_90']:.2f} req/s "
              f"({summary['goodput_per_gpu_at_90']:.4f} per GPU)")
    return 0


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _print_summary(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"{r['requests']} requests on {c['gpu']} TP={c['tp']} {c['tiers']} routing={c['routing']} "
          f"autoscale={c['autoscale']}")
    print(f"  done {r['done']}, rejected {r['rejected']}; SLO attainment {r['slo_attainment']:.1%} "
          f"(TTFT <= {r['slo']['ttft_s']} s, TPOT <= {r['slo']['itl_s']} s); goodput {r['goodput_rps']:.2f} req/s")
    print(f"  TTFT p50/p90/p99 {_fmt(r['ttft_s'])}; ITL p50/p90/p99 {_fmt(r['itl_s'])}")
    print(f"  GPU-hours {r['gpu_hours']:.2f}; prefix hit rate {r['prefix_hit_rate']:.1%}; scale events "
          f"{r['scale_events']}; failed during drains {r['failed_during_drain']}")
    print(f"  simulated {r['simulated_s']:.0f} s in {r['wall_s']:.1f} s wall, peak RSS {r['peak_rss_mb']:.0f} MB")


def _fmt(d: dict[str, float | None]) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.3f}" for k in ("p50", "p90", "p99")) + " s"
