"""The planner's observations of one TandemDeployment, read from Prometheus' HTTP API (``GET /api/v1/query``).

Every query names the router's metrics (router/metric_catalogue.py; a test checks each name is there, as operators
may not import the router) and is scoped by the deployment's label matchers ``S`` over a range ``W``
(``spec.autoscaling.windowSeconds``)::

    request rate       sum(rate(tandem_request_prompt_tokens_count{S}[W]))         (one sample per finished request)
    input length       mean: rate of _sum over rate of _count; p90: histogram_quantile over _bucket
    output length      the same over tandem_request_generation_tokens
    prefix hit rate    rate(tandem_prompt_cached_tokens_total) over rate(tandem_prompt_tokens_total)
    TTFT, ITL          histogram_quantile(0.5 | 0.9 | 0.99, sum by (le) (rate(tandem_{ttft,itl}_seconds_bucket)))
    queue, per tier    sum by (role) (max by (worker, role) (tandem_worker_queue_depth{S}))
    KV use, per tier   used blocks over used + free blocks, summed the same way

The worker gauges are the router's view of each worker's last ``Load``: with several router replicas each reports
every worker, so ``max by (worker, role)`` counts a worker once. A worker's ``role`` label is its tier's name.
Replica counts (ready, starting, draining) are not read here: the controller's ``Status`` is their source of truth.

A range with no requests gives NaN quantiles and ratios: quantiles become "not measured" (None), lengths and the hit
rate 0. No series at all for ``tandem_worker_up{S}`` means the selector matches nothing (the router is not scraped,
or the selector is wrong): that raises ``PrometheusError`` rather than reporting an idle deployment, which would
drain it.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import httpx

from operators.planner.observations import LengthStats, Observations, Percentiles, TierObservation

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# Every metric family the queries read (a test checks them against router/metric_catalogue.py).
METRICS = ("tandem_request_prompt_tokens", "tandem_request_generation_tokens", "tandem_prompt_tokens",
           "tandem_prompt_cached_tokens", "tandem_ttft_seconds", "tandem_itl_seconds", "tandem_worker_queue_depth",
           "tandem_kv_blocks_used", "tandem_kv_blocks_free", "tandem_worker_up")


class PrometheusError(RuntimeError):
    """Prometheus could not be queried, or it has no series of the deployment."""


def _ratio(num: str, den: str) -> str:
    return f"({num}) / ({den})"


def queries(s: str, window_s: float) -> dict[str, str]:
    """Every PromQL expression one observation needs, by key, over matchers ``s`` and a range of ``window_s``."""
    w = f"{max(round(window_s), 1)}s"

    def rate(series: str) -> str:
        return f"sum(rate({series}{{{s}}}[{w}]))"

    def quantile(q: float, family: str) -> str:
        return f"histogram_quantile({q}, sum by (le) (rate({family}_bucket{{{s}}}[{w}])))"

    def per_role(family: str) -> str:
        return f"sum by (role) (max by (worker, role) ({family}{{{s}}}))"

    out = {
        "workers": f"count(tandem_worker_up{{{s}}})",
        "rate": rate("tandem_request_prompt_tokens_count"),
        "hit_rate": _ratio(rate("tandem_prompt_cached_tokens_total"), rate("tandem_prompt_tokens_total")),
        "queue": per_role("tandem_worker_queue_depth"),
        "kv": _ratio(per_role("tandem_kv_blocks_used"),
                     f"sum by (role) (max by (worker, role) (tandem_kv_blocks_used{{{s}}} + "
                     f"tandem_kv_blocks_free{{{s}}}))"),
    }
    for key, family in (("input", "tandem_request_prompt_tokens"), ("output", "tandem_request_generation_tokens")):
        out[f"{key}_mean"] = _ratio(rate(f"{family}_sum"), rate(f"{family}_count"))
        out[f"{key}_p90"] = quantile(0.9, family)
    for key, family in (("ttft", "tandem_ttft_seconds"), ("itl", "tandem_itl_seconds")):
        for name, q in QUANTILES.items():
            out[f"{key}_{name}"] = quantile(q, family)
    return out


Vector = list[tuple[dict[str, str], float]]


async def query(client: httpx.AsyncClient, url: str, expr: str) -> Vector:
    """One instant query; its samples as (labels, value). PrometheusError on any failure, naming the query."""
    try:
        r = await client.get(url.rstrip("/") + "/api/v1/query", params={"query": expr})
    except httpx.HTTPError as e:
        raise PrometheusError(f"querying {url}: {type(e).__name__}: {e}") from e
    try:
        body = r.json()
    except ValueError:
        raise PrometheusError(f"{url} answered {r.status_code} without JSON to {expr!r}") from None
    if r.status_code != 200 or body.get("status") != "success":
        raise PrometheusError(f"{url} refused {expr!r}: {r.status_code} {body.get('error', '')}".rstrip())
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusError(f"{expr!r}: expected a vector, got {data.get('resultType')!r}")
    return [(dict(x.get("metric") or {}), float(x["value"][1])) for x in data.get("result") or []]


@dataclass(slots=True, frozen=True)
class TierCounts:
    """One tier's replicas, from the controller."""

    ready: int
    starting: int = 0
    draining: int = 0


def _scalar(v: Vector) -> float | None:
    """The value of a one-sample aggregate; None when absent or NaN."""
    if not v or not math.isfinite(v[0][1]):
        return None
    return v[0][1]


def _by_role(v: Vector) -> dict[str, float]:
    return {labels.get("role", ""): value for labels, value in v if math.isfinite(value)}


def observations(results: dict[str, Vector], time_s: float, window_s: float,
                 tiers: dict[str, TierCounts]) -> Observations:
    """The planner's ``Observations`` from the answers to ``queries`` (pure: tests feed it directly)."""
    if not results["workers"] or not _scalar(results["workers"]):
        raise PrometheusError("no tandem_worker_up series match the selector: is the router scraped, and does "
                              "spec.autoscaling.selector name its labels?")

    def nonneg(key: str) -> float:
        return max(_scalar(results[key]) or 0.0, 0.0)

    def pct(key: str) -> Percentiles:
        return Percentiles(*(_scalar(results[f"{key}_{name}"]) for name in QUANTILES))

    queue, kv = _by_role(results["queue"]), _by_role(results["kv"])
    return Observations(
        time_s=time_s, window_s=window_s, request_rate=nonneg("rate"),
        input_len=LengthStats(nonneg("input_mean"), nonneg("input_p90")),
        output_len=LengthStats(nonneg("output_mean"), nonneg("output_p90")),
        prefix_hit_rate=min(nonneg("hit_rate"), 1.0), ttft=pct("ttft"), itl=pct("itl"),
        tiers=tuple(TierObservation(name, c.ready, c.starting, c.draining, queue_depth=max(queue.get(name, 0.0), 0.0),
                                    kv_utilisation=min(max(kv.get(name, 0.0), 0.0), 1.0))
                    for name, c in tiers.items()))


async def observe(url: str, matchers: str, window_s: float, step_s: float, time_s: float,
                  tiers: dict[str, TierCounts], timeout_s: float = 10.0) -> Observations:
    """Query everything at once and build the observation of a window of ``step_s`` ending at ``time_s``."""
    exprs = queries(matchers, window_s)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        answers = await asyncio.gather(*(query(client, url, e) for e in exprs.values()))
    return observations(dict(zip(exprs, answers, strict=True)), time_s, step_s, tiers)
