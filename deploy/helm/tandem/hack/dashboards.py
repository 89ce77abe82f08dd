"""Writes the chart's Grafana dashboards (deploy/helm/tandem/dashboards/*.json) from the panel lists below.

Why generated: four dashboards share one datasource variable, one worker variable, the SLO constants and one panel
shape; written by hand they drift, and a renamed metric would leave a panel silently empty. Plain JSON from one
script (grafana-foundation-sdk is not installable here); the chart packages each file as a ConfigMap with the
Grafana sidecar's ``grafana_dashboard: "1"`` label. Every query names only metrics listed in
router/metric_catalogue.py (tests/test_dashboards.py), and each returns data from a real Prometheus scraping
``tandem up`` under load (tests/test_dashboards_live.py).

    python3 deploy/helm/tandem/hack/dashboards.py          # rewrite the JSON files
    python3 deploy/helm/tandem/hack/dashboards.py --check  # exit 1 if a committed file differs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "dashboards"
TTFT_SLO_S = "1"  # the SLO targets drawn beside the percentiles (constants the user edits in Grafana)
ITL_SLO_S = "0.1"
RATE = "[$__rate_interval]"
W = '{worker=~"$worker"}'


@dataclass(slots=True, frozen=True)
class Panel:
    title: str
    description: str
    exprs: tuple[tuple[str, str], ...]  # (legend, PromQL)
    unit: str = "short"


def _quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"p{float(q) * 100:g}", f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{RATE})))")
                 for q in ("0.5", "0.9", "0.99"))


OVERVIEW = (
    Panel("Time to first token", "TTFT percentiles as clients see them, against the SLO target",
          (*_quantiles("tandem_ttft_seconds"), ("SLO", "vector($ttft_slo)")), "s"),
    Panel("Inter-token latency", "ITL percentiles of streamed responses, against the SLO target",
          (*_quantiles("tandem_itl_seconds"), ("SLO", "vector($itl_slo)")), "s"),
    Panel("End-to-end latency", "Request latency from arrival to the last byte",
          _quantiles("tandem_e2e_latency_seconds"), "s"),
    Panel("Requests per second", "Responses by endpoint",
          (("{{endpoint}}", f"sum by (endpoint) (rate(tandem_requests_total{RATE}))"),), "reqps"),
    Panel("Tokens per second", "Prompt tokens received and tokens generated",
          (("prompt", f"sum(rate(tandem_prompt_tokens_total{RATE}))"),
           ("generated", f"sum(rate(tandem_generation_tokens_total{RATE}))"))),
    Panel("Errors by status", "Responses that were not 2xx, by status",
          (("{{status}}", f'sum by (status) (rate(tandem_requests_total{{status!~"2.."}}{RATE}))'),), "reqps"),
    Panel("Finish reasons", "Finished sequences by why they ended",
          (("{{finished_reason}}", f"sum by (finished_reason) (rate(tandem_request_success_total{RATE}))"),)),
)

ROUTER = (
    Panel("Routing decisions", "Decisions by mode and reason",
          (("{{mode}} / {{reason}}", f"sum by (mode, reason) (rate(tandem_router_decisions_total{RATE}))"),)),
    Panel("Prefix cache hit rate", "Prompt tokens served from the prefix cache over prompt tokens",
          (("window", f"sum(rate(tandem_prompt_cached_tokens_total{RATE})) / "
                      f"sum(rate(tandem_prompt_tokens_total{RATE}))"),
           ("since start", "tandem_prefix_cache_hit_rate")), "percentunit"),
    Panel("Running requests per worker", "Requests running or receiving KV, per worker",
          (("{{worker}}", f"tandem_worker_running_requests{W}"),)),
    Panel("Queued requests per worker", "Requests waiting to be scheduled, per worker",
          (("{{worker}}", f"tandem_worker_queue_depth{W}"),)),
    Panel("Retries and migrations", "Requests retried on another worker; streams migrated after a decode failure",
          (("retries", f"sum(rate(tandem_router_retries_total{RATE}))"),
           ("migrations", f"sum(rate(tandem_router_migrations_total{RATE}))"))),
    Panel("Worker cut-offs", "Workers silent past the dead-after bound whose requests were failed over",
          (("{{worker}}", f"sum by (worker) (increase(tandem_router_worker_cutoffs_total{W}{RATE}))"),)),
    Panel("Admission refusals", "Requests refused with 429, by the tier that was full",
          (("{{tier}}", f"sum by (tier) (rate(tandem_admission_rejected_total{RATE}))"),), "reqps"),
    Panel("Queue and prefill time", "Router queue (parse, admission) and handoff-to-first-token, p90",
          (("queue p90",
            f"histogram_quantile(0.9, sum by (le) (rate(tandem_request_queue_time_seconds_bucket{RATE})))"),
           ("prefill p90",
            f"histogram_quantile(0.9, sum by (le) (rate(tandem_request_prefill_time_seconds_bucket{RATE})))")), "s"),
    Panel("Workers up", "1 per worker answering health checks", (("{{worker}}", f"tandem_worker_up{W}"),)),
)

KV_TRANSFER = (
    Panel("KV bytes per second", "KV bytes handed to the transport, per backend",
          (("{{backend}}", f"sum by (backend) (rate(tandem_kv_transfer_bytes_total{RATE}))"),), "Bps"),
    Panel("KV transfers per second", "Finished outgoing transfers, per backend",
          (("{{backend}}", f"sum by (backend) (rate(tandem_kv_transfers_total{RATE}))"),)),
    Panel("Exposed transfer time", "Mean time a transfer outlived its prefill's compute (not hidden by overlap)",
          (("{{backend}}", f"sum by (backend) (rate(tandem_kv_transfer_exposed_seconds_total{RATE})) / "
            f"sum by (backend) (rate(tandem_kv_transfers_total{RATE}))"),), "s"),
    Panel("KV transfer latency", "Outgoing transfer time, first layer handed to the transport until done, p50 "
          "and p99 per backend (each prefill worker's own /metrics)",
          tuple((f"{{{{backend}}}} p{q[2:]}", f"histogram_quantile({q}, sum by (le, backend) "
                 f"(rate(tandem_kv_transfer_seconds_bucket{W}{RATE})))") for q in ("0.50", "0.99")), "s"),
    Panel("KV landing wait", "Incoming KV wait, blocks reserved on a decode worker until the last layer landed, p50 "
          "and p99 per backend (each decode worker's own /metrics)",
          tuple((f"{{{{backend}}}} p{q[2:]}", f"histogram_quantile({q}, sum by (le, backend) "
                 f"(rate(tandem_kv_landing_seconds_bucket{W}{RATE})))") for q in ("0.50", "0.99")), "s"),
    Panel("KV transfer failures", "Failed transfers (error or lease expired), per backend",
          (("{{backend}}", f"sum by (backend) (increase(tandem_kv_transfer_failures_total{RATE}))"),)),
    Panel("Transfers in flight", "KV transfers in flight per worker",
          (("{{worker}}", f"tandem_kv_transfers_in_flight{W}"),)),
    Panel("TTFT by mode", "TTFT p90, colocated against disaggregated (prefill plus the KV handoff)",
          (("{{mode}}", f"histogram_quantile(0.9, sum by (le, mode) (rate(tandem_ttft_seconds_bucket{RATE})))"),),
          "s"),
)

TIERS = (
    Panel("Replicas desired and ready", "Per tier, from the controller",
          (("{{tier}} desired", "tandem_tier_replicas_desired"), ("{{tier}} ready", "tandem_tier_replicas_ready"))),
    Panel("Queue depth per tier", "Requests waiting on each tier's workers",
          (("{{role}}", "sum by (role) (tandem_worker_queue_depth)"),)),
    Panel("Running requests per tier", "Requests running on each tier's workers",
          (("{{role}}", "sum by (role) (tandem_worker_running_requests)"),)),
    Panel("KV utilisation per tier", "KV blocks in use over all blocks, per tier",
          (("{{role}}", "sum by (role) (tandem_kv_blocks_used) / (sum by (role) (tandem_kv_blocks_used) + "
            "sum by (role) (tandem_kv_blocks_free))"),), "percentunit"),
    Panel("Workers up per tier", "Workers answering health checks, per tier",
          (("{{role}}", "sum by (role) (tandem_worker_up)"),)),
)

DASHBOARDS: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "overview": ("Tandem / Overview", OVERVIEW),
    "router": ("Tandem / Router", ROUTER),
    "kv-transfer": ("Tandem / KV transfer", KV_TRANSFER),
    "tiers": ("Tandem / Tiers", TIERS),
}


def _variables() -> list[dict[str, Any]]:
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    return [
        {"name": "DS_PROMETHEUS", "label": "datasource", "type": "datasource", "query": "prometheus", "hide": 0},
        {"name": "worker", "label": "worker", "type": "query", "datasource": ds, "refresh": 2,
         "query": {"query": "label_values(tandem_worker_up, worker)", "refId": "worker"},
         "definition": "label_values(tandem_worker_up, worker)", "includeAll": True, "multi": True,
         "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
        {"name": "ttft_slo", "label": "TTFT SLO (s)", "type": "constant", "query": TTFT_SLO_S, "hide": 2},
        {"name": "itl_slo", "label": "ITL SLO (s)", "type": "constant", "query": ITL_SLO_S, "hide": 2},
    ]


def _panel(i: int, p: Panel) -> dict[str, Any]:
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    return {
        "id": i + 1, "type": "timeseries", "title": p.title, "description": p.description, "datasource": ds,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [{"datasource": ds, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j),
                     "range": True} for j, (legend, expr) in enumerate(p.exprs)],
    }


def dashboard(uid: str) -> dict[str, Any]:
    title, panels = DASHBOARDS[uid]
    return {
        "uid": f"tandem-{uid}", "title": title, "tags": ["tandem"], "timezone": "browser", "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables()},
        "panels": [_panel(i, p) for i, p in enumerate(panels)],
    }


def rendered() -> dict[Path, str]:
    return {OUT / f"{uid}.json": json.dumps(dashboard(uid), indent=2) + "\n" for uid in DASHBOARDS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a committed dashboard differs from the generator")
    args = p.parse_args()
    files = rendered()
    if args.check:
        stale = sorted(str(path) for path, text in files.items() if not path.exists() or path.read_text() != text)
        extra = sorted(str(path) for path in OUT.glob("*.json") if path not in files)
        if stale or extra:
            print(f"dashboards out of date (run {Path(__file__).name}): {stale + extra}", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
