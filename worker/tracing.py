"""Opt-in OpenTelemetry spans of a worker's part of a request, children of the router's trace.

The router opens each request's root span before it routes it and sends its W3C trace context (``traceparent``) as
gRPC metadata on ``Reserve``, ``Prefill`` and ``Decode`` (router/tracing.py). A worker started with
``--otlp-endpoint`` records its phases under that parent, so one disaggregated request is one trace across the
router and both workers:

- prefill worker: ``prefill_worker.prefill``, the ``Prefill`` call (queueing, the prompt's forward, the first
  token), and ``prefill_worker.kv_transfer``, from the prompt's first layer handed to the transport until the
  transport reported the send DONE or FAILED (attributes: bytes, backend, ok), which may end after the call;
- decode worker: ``decode_worker.kv_landing``, from the blocks reserved (the receive open) until the last layer
  landed or the transfer failed, and ``decode_worker.decode``, the ``Decode`` stream (tokens sent).

A call without trace context records nothing (colocated requests ride the session stream, which carries none);
with the flag unset no tracer exists and the handlers pay one ``None`` check. Spans are recorded when a phase ends,
from perf_counter timestamps, as the router records its own; a phase that ends on another thread than the one that
began it (the transfer's end, seen by the engine loop) finds its parent in a bounded table keyed by request id.
Export is OTLP over gRPC through the SDK's batch processor.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from decode_worker.connector import DecodeConnector
from prefill_worker.connector import PrefillConnector, TransferTiming

if TYPE_CHECKING:
    from worker.service import WorkerService

_W3C = TraceContextTextMapPropagator()
MAX_HELD = 4096  # parents of phases still open; the oldest go first (a request aborted before its phase ended)


def otlp_provider(endpoint: str, service_name: str) -> TracerProvider:
    """A provider exporting to an OTLP/gRPC collector at ``endpoint`` (plain text: a collector beside the worker)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return provider


def tracer_for(service: WorkerService, endpoint: str | None) -> WorkerTracer | None:
    """The tracer of a worker started with ``--otlp-endpoint endpoint`` (None without it), hooked to the end of
    its connector's transfers (prefill) or landings (decode)."""
    if not endpoint:
        return None
    tracer = WorkerTracer(otlp_provider(endpoint, f"tandem-worker-{service.role}"), service.kv_backend)
    connector = getattr(service, "connector", None)
    if isinstance(connector, PrefillConnector):
        connector.on_transfer.append(tracer.transfer_ended)
    elif isinstance(connector, DecodeConnector):
        connector.on_landed.append(tracer.landed)
    return tracer


class WorkerTracer:
    def __init__(self, provider: TracerProvider, backend: str) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tandem.worker")
        self.backend = backend
        self._held: OrderedDict[str, tuple[Context, float]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def parent(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
        """The router's trace context in a call's metadata, or None when the call carries none."""
        carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
        if "traceparent" not in carrier:
            return None
        ctx = _W3C.extract(carrier)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def span(self, name: str, parent: Context, start: float, end: float, attributes: dict[str, Any]) -> None:
        """Record a finished phase ``start``..``end`` (perf_counter) under ``parent``."""
        now_ns, now = time.time_ns(), time.perf_counter()
        self.tracer.start_span(name, context=parent, start_time=now_ns - int((now - start) * 1e9),
                               attributes=attributes).end(end_time=now_ns - int((now - end) * 1e9))

    def hold(self, request_id: str, parent: Context, since: float = 0.0) -> None:
        """Keep ``request_id``'s parent for a phase that ends later, elsewhere (``release``)."""
        with self._lock:
            self._held[request_id] = (parent, since)
            while len(self._held) > MAX_HELD:
                self._held.popitem(last=False)

    def release(self, request_id: str, name: str, end: float, attributes: dict[str, Any],
                start: float | None = None) -> None:
        """End the held phase of ``request_id`` (from ``start``, else from when it was held); nothing if none."""
        with self._lock:
            held = self._held.pop(request_id, None)
        if held is not None:
            self.span(name, held[0], held[1] if start is None else start, end, attributes)

    # ---- the connectors' hooks (engine loop thread) ---------------------------------------------------------

    def transfer_ended(self, t: TransferTiming) -> None:
        self.release(t.request_id, "prefill_worker.kv_transfer", t.transfer_done,
                     {"tandem.request_id": t.request_id, "tandem.kv.backend": self.backend,
                      "tandem.kv.bytes": t.bytes_sent, "tandem.kv.ok": t.ok}, start=t.started)

    def landed(self, request_id: str, ok: bool) -> None:
        self.release(request_id, "decode_worker.kv_landing", time.perf_counter(),
                     {"tandem.request_id": request_id, "tandem.kv.backend": self.backend, "tandem.kv.ok": ok})

    def shutdown(self) -> None:
        self.provider.shutdown()
