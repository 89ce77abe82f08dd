"""Every Prometheus metric Tandem exports, named once: its type, help text, labels, histogram buckets and, where
vLLM has an equivalent, the ``vllm:*`` name it is also exported under with ``--vllm-metrics``.

The router serves nearly all of them: workers answer ``Load`` over gRPC and the router turns each worker's latest
report into per-worker gauges at scrape time (router/metrics.py). The exceptions (``exporter="worker"``) are the KV
transfer histograms, which a prefill worker observes as each transfer ends and serves on its own ``/metrics``
(``tandem worker --metrics-port``, worker/metrics.py; the worker is handed these entries, as it may not import the
router). The dashboards' generator
(deploy/helm/tandem/dashboards/generate.py) and the alert rules' tests read this module to check that every
query names a metric that exists here. A leaf module: it imports nothing of Tandem, so anything may import it.

Latency buckets suit LLM serving: TTFT and end-to-end from 1 ms to 2 min, ITL from 0.5 ms to 5 s; token-count
buckets are vLLM's 1-2-5 series. Router-measured phases: *queue* is arrival until the request is handed to routing
(body read, parse, tokenise, admission), *prefill* from there to the first token (the worker's own queueing, the
prefill and, disaggregated, the first layer's KV handoff included), *decode* from the first token to the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BYTE_BUCKETS = tuple(float(4**k) for k in range(8, 17))  # 64 KiB .. 4 GiB, x4
WORKER = ("worker", "role")
KV_WORKER = ("worker", "role", "backend")
Exporter = Literal["router", "worker"]


@dataclass(slots=True, frozen=True)
class MetricSpec:
    """One metric family. ``name`` is the family name (a counter's samples get ``_total``, Prometheus' rule)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    vllm: str | None = None  # the vLLM family exported beside it with --vllm-metrics (a ``model_name`` label added)
    exporter: Exporter = "router"  # the process whose /metrics serves it

    def __post_init__(self) -> None:
        if not self.name.startswith("tandem_"):
            raise ValueError(f"{self.name}: every Tandem metric is prefixed tandem_")
        if self.kind == "counter" and self.name.endswith("_total"):
            raise ValueError(f"{self.name}: a counter family is named without _total")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only they, have buckets")
        if self.vllm is not None and not self.vllm.startswith("vllm:"):
            raise ValueError(f"{self.name}: a vLLM name starts with vllm:, got {self.vllm}")
        if self.exporter not in ("router", "worker"):
            raise ValueError(f"{self.name}: exported by the router or a worker, not {self.exporter!r}")


def _h(name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = (),
       vllm: str | None = None, exporter: Exporter = "router") -> MetricSpec:
    return MetricSpec(name, "histogram", help, labels, buckets, vllm, exporter)


def _c(name: str, help: str, labels: tuple[str, ...] = (), vllm: str | None = None) -> MetricSpec:
    return MetricSpec(name, "counter", help, labels, (), vllm)


def _g(name: str, help: str, labels: tuple[str, ...] = (), vllm: str | None = None) -> MetricSpec:
    return MetricSpec(name, "gauge", help, labels, (), vllm)


SPEC_WORKER = ("worker", "role")

METRICS: tuple[MetricSpec, ...] = (
    # latency, as the client sees it (measured by the router)
    _h("tandem_ttft_seconds", "Time to first token, as the client sees it, by routing mode", LATENCY_BUCKETS,
       ("mode",), "vllm:time_to_first_token_seconds"),
    _h("tandem_itl_seconds", "Inter-token latency of streamed responses", ITL_BUCKETS, (),
       "vllm:time_per_output_token_seconds"),
    _h("tandem_e2e_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS, (),
       "vllm:e2e_request_latency_seconds"),
    _h("tandem_request_queue_time_seconds", "Arrival until handed to routing (read, parse, tokenise, admission)",
       LATENCY_BUCKETS, (), "vllm:request_queue_time_seconds"),
    _h("tandem_request_prefill_time_seconds", "Handed to routing until the first token (worker queueing, prefill "
       "and the KV handoff included)", LATENCY_BUCKETS, (), "vllm:request_prefill_time_seconds"),
    _h("tandem_request_decode_time_seconds", "First token until the last", LATENCY_BUCKETS, (),
       "vllm:request_decode_time_seconds"),
    _h("tandem_request_inference_time_seconds", "Handed to routing until the last token", LATENCY_BUCKETS, (),
       "vllm:request_inference_time_seconds"),
    # requests and tokens
    _c("tandem_requests", "Responses by endpoint and HTTP status", ("endpoint", "status")),
    _c("tandem_request_success", "Finished sequences by finish reason", ("finished_reason",),
       "vllm:request_success"),
    _c("tandem_admission_rejected", "Requests refused with 429 by admission control, by tier", ("tier",)),
    _c("tandem_prompt_tokens", "Prompt tokens received", (), "vllm:prompt_tokens"),
    _c("tandem_prompt_cached_tokens", "Prompt tokens served from prefix cache", (), "vllm:prefix_cache_hits"),
    _c("tandem_generation_tokens", "Tokens generated", (), "vllm:generation_tokens"),
    _h("tandem_request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS, (),
       "vllm:request_prompt_tokens"),
    _h("tandem_request_generation_tokens", "Generated tokens per request (all its sequences)", TOKEN_BUCKETS, (),
       "vllm:request_generation_tokens"),
    _h("tandem_request_max_num_generation_tokens", "Most tokens one sequence of a request generated",
       TOKEN_BUCKETS, (), "vllm:request_max_num_generation_tokens"),
    _g("tandem_prefix_cache_hit_rate", "Prompt tokens served from prefix cache over prompt tokens, since start"),
    # routing
    _c("tandem_router_decisions", "Routing decisions by mode and reason", ("mode", "reason")),
    _c("tandem_router_retries", "Requests retried on another worker"),
    _c("tandem_router_migrations", "Streams migrated after a decode failure"),
    _c("tandem_router_worker_cutoffs", "Times a worker that answered no probe had its in-flight requests failed "
       "over", WORKER),
    # workers, from their latest Load report
    _g("tandem_worker_up", "1 if the worker answers health checks", WORKER),
    _g("tandem_kv_blocks_used", "KV cache blocks in use", WORKER),
    _g("tandem_kv_blocks_free", "KV cache blocks free (incl. evictable cached)", WORKER),
    _g("tandem_kv_cache_usage_ratio", "KV cache blocks in use over all blocks", WORKER, "vllm:gpu_cache_usage_perc"),
    _g("tandem_worker_queue_depth", "Requests waiting to be scheduled", WORKER, "vllm:num_requests_waiting"),
    _g("tandem_worker_running_requests", "Requests running or receiving KV", WORKER, "vllm:num_requests_running"),
    _g("tandem_kv_transfers_in_flight", "KV transfers in flight", WORKER),
    _g("tandem_worker_generated_tokens", "Output tokens the worker produced since it started (its own count)",
       WORKER),
    _c("tandem_kv_transfers", "Outgoing KV transfers finished, by prefill worker and backend", KV_WORKER),
    _c("tandem_kv_transfer_failures", "Outgoing KV transfers failed (error or lease expired)", KV_WORKER),
    _c("tandem_kv_transfer_bytes", "KV bytes handed to the transport", KV_WORKER),
    _c("tandem_kv_transfer_exposed_seconds", "Seconds finished KV transfers outlived their prefill's compute (the "
       "transfer time layer-wise overlap did not hide)", KV_WORKER),
    # served by each prefill worker on its own /metrics (worker/metrics.py)
    _h("tandem_kv_transfer_seconds", "Outgoing KV transfer time, first layer handed to the transport until it "
       "reported the send done or failed, by prefill worker, backend and outcome", KV_TRANSFER_BUCKETS,
       (*KV_WORKER, "outcome"), exporter="worker"),
    _h("tandem_kv_transfer_size_bytes", "Bytes one finished outgoing KV transfer moved, by prefill worker and "
       "backend", BYTE_BUCKETS, KV_WORKER, exporter="worker"),
    # served by each decode worker on its own /metrics (worker/metrics.py)
    _h("tandem_kv_landing_seconds", "Incoming KV wait, blocks reserved for a remote prefill until its last layer "
       "landed or the transfer failed, by decode worker, backend and outcome", KV_TRANSFER_BUCKETS,
       (*KV_WORKER, "outcome"), exporter="worker"),
    # served by each speculating worker on its own /metrics (worker/metrics.py), read from its engine at scrape
    MetricSpec("tandem_spec_decode_drafts", "counter", "Request-steps with speculative proposals verified",
               SPEC_WORKER, exporter="worker"),
    MetricSpec("tandem_spec_decode_draft_tokens", "counter", "Speculative tokens proposed and verified", SPEC_WORKER,
               exporter="worker"),
    MetricSpec("tandem_spec_decode_accepted_tokens", "counter", "Speculative tokens accepted", SPEC_WORKER,
               exporter="worker"),
    MetricSpec("tandem_spec_decode_acceptance_rate", "gauge", "Accepted over proposed speculative tokens, since start",
               SPEC_WORKER, exporter="worker"),
    MetricSpec("tandem_spec_decode_mean_accepted_length", "gauge", "Tokens emitted per speculated request-step (1 "
               "plus the accepted proposals), since start", SPEC_WORKER, exporter="worker"),
    # tiers, from the controller's Status when one is attached (tandem up)
    _g("tandem_tier_replicas_desired", "Replicas the controller is asked to keep, by tier", ("tier",)),
    _g("tandem_tier_replicas_ready", "Replicas ready (lease in the registry), by tier", ("tier",)),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
WORKER_METRICS: dict[str, MetricSpec] = {m.name: m for m in METRICS if m.exporter == "worker"}
VLLM_ALIASES: dict[str, str] = {m.name: m.vllm for m in METRICS if m.vllm is not None}
# newer vLLM releases renamed the KV gauge and count prefix-cache queries; both names are exported
EXTRA_VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "tandem_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc",),
    "tandem_prompt_tokens": ("vllm:prefix_cache_queries",),
    "tandem_itl_seconds": ("vllm:inter_token_latency_seconds",),
}


def spec(name: str) -> MetricSpec:
    """The catalogue entry of ``name`` (KeyError naming it when the code uses a metric the catalogue lacks)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in router/metric_catalogue.py") from None


def series_names(m: MetricSpec) -> tuple[str, ...]:
    """The sample names Prometheus stores for ``m``."""
    if m.kind == "counter":
        return (m.name + "_total",)
    if m.kind == "histogram":
        return (m.name + "_bucket", m.name + "_sum", m.name + "_count")
    return (m.name,)


def exported_series() -> frozenset[str]:
    """Every sample name Tandem exports (tandem_* always; vllm:* with --vllm-metrics)."""
    out: set[str] = set()
    for m in METRICS:
        out.update(series_names(m))
        for alias in (m.vllm, *EXTRA_VLLM_ALIASES.get(m.name, ())):
            if alias is not None:
                out.update(s.replace(m.name, alias, 1) for s in series_names(m))
    return frozenset(out)
