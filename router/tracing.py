"""Opt-in OpenTelemetry traces of requests: one trace per request, a root span for the router and, as its children,
the phases the router observes: ``prefill``, ``kv_transfer`` and ``decode`` for a disaggregated request, ``generate``
for a colocated one.

The root span opens as the request is handed to routing (``begin``), so its W3C trace context (``traceparent``)
goes to the workers as gRPC metadata on ``Reserve``, ``Prefill`` and ``Decode``; workers started with
``--otlp-endpoint`` add their own spans under it (worker/tracing.py: the worker's prefill, the KV transfer with its
bytes and backend, the KV landing and the decode), so one disaggregated request is one trace across the processes.
Colocated requests travel on the worker's session stream, which carries no per-request metadata: their trace is the
router's alone. The router's phases are recorded when the request ends, from the timestamps the gateway already
keeps per sequence (handed to routing, first token, first token from the decode worker, last token), so tracing
adds no work to the token path, and nothing at all when it is off (``--otlp-endpoint`` unset: no tracer exists).
What each phase spans, as the router sees it: ``prefill`` from routing until prefill's first token (the worker's
queueing and the prefill's compute, its layer-wise KV streaming overlapping it), ``kv_transfer`` from that token
until decode's first chunk (the transfer's tail that layer-wise streaming did not hide, and decode's first step),
``decode`` from there to the last token. Export is OTLP over gRPC through the SDK's batch processor
(``--otlp-endpoint host:port``); tests hand in a provider with an in-memory exporter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_W3C = TraceContextTextMapPropagator()


@dataclass(slots=True, frozen=True)
class Phases:
    """One sequence's timestamps (perf_counter seconds; 0 where none came)."""

    arrived: float
    dispatched: float
    first_token: float
    second_chunk: float
    end: float


def otlp_provider(endpoint: str, service_name: str = "tandem-router") -> TracerProvider:
    """A provider exporting to an OTLP/gRPC collector at ``endpoint`` (plain text: a collector beside the router)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return provider


class RequestTracer:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tandem.router")

    def begin(self, arrived: float) -> Span:
        """Open a request's root span, started at ``arrived`` (perf_counter); ``record`` ends it."""
        return self.tracer.start_span("tandem.request", start_time=_ns(arrived))

    @staticmethod
    def metadata(root: Span) -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying ``root``'s W3C trace context to the workers."""
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=set_span_in_context(root))
        return tuple(carrier.items())

    def record(self, endpoint: str, mode: str, p: Phases, attributes: dict[str, Any],
               root: Span | None = None) -> None:
        """Emit one request's trace: its phases under ``root`` (from ``begin``; None: a root opened here), then
        end the root."""
        now_ns, now = time.time_ns(), time.perf_counter()  # one reading: adjoining phases share their bounds

        def ns(t: float) -> int:
            return now_ns - int((now - t) * 1e9)

        attrs = {"http.route": endpoint, "tandem.mode": mode, **attributes}
        if root is None:
            root = self.tracer.start_span("tandem.request", start_time=ns(p.arrived))
        root.set_attributes(attrs)
        ctx = set_span_in_context(root)
        if mode == "disaggregated" and p.first_token:
            phases = [("prefill", p.dispatched, p.first_token)]
            if p.second_chunk:
                phases += [("kv_transfer", p.first_token, p.second_chunk), ("decode", p.second_chunk, p.end)]
        else:
            phases = [("generate", p.dispatched, p.end)]
        for name, start, end in phases:
            self.tracer.start_span(name, context=ctx, start_time=ns(start)).end(end_time=ns(end))
        root.end(end_time=ns(p.end))

    def shutdown(self) -> None:
        self.provider.shutdown()


def _ns(t: float) -> int:
    """A perf_counter reading as wall-clock nanoseconds (what spans are timed in)."""
    return time.time_ns() - int((time.perf_counter() - t) * 1e9)
