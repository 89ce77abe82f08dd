"""The worker's half of request tracing (worker/tracing.py), in process with the SDK's in-memory exporter: the
router's ``traceparent`` metadata becomes the parent of the worker's spans, a call without one records nothing, a
transfer's span carries its bytes, backend and outcome (a failed one too), and the table of parents held for phases
that end later stays bounded."""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prefill_worker.connector import TransferTiming
from router.tracing import RequestTracer
from worker import tracing
from worker.tracing import WorkerTracer


def _attr(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes[key]


def _tracers() -> tuple[RequestTracer, WorkerTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider), WorkerTracer(provider, "nixl"), exporter


def test_the_routers_metadata_parents_the_workers_spans_and_no_metadata_records_nothing() -> None:
    router, worker, exporter = _tracers()
    root = router.begin(time.perf_counter())
    meta = router.metadata(root)
    assert [k for k, _ in meta] == ["traceparent"]
    parent = worker.parent([*meta, ("authorization", "Bearer x"), ("bin-bin", b"\x00")])
    assert parent is not None
    assert worker.parent([("authorization", "Bearer x")]) is None and worker.parent(None) is None
    assert worker.parent([("traceparent", "00-not-a-trace-01")]) is None
    t0 = time.perf_counter()
    worker.span("prefill_worker.prefill", parent, t0, t0 + 0.01, {"tandem.request_id": "r"})
    (span,) = exporter.get_finished_spans()
    assert span.parent is not None and root.get_span_context().span_id == span.parent.span_id
    assert span.context is not None and span.context.trace_id == root.get_span_context().trace_id
    assert span.end_time is not None and span.start_time is not None
    assert abs((span.end_time - span.start_time) - 10_000_000) < 1_000  # ns


def test_a_held_transfer_ends_as_a_span_with_bytes_backend_and_outcome() -> None:
    router, worker, exporter = _tracers()
    parent = worker.parent(router.metadata(router.begin(time.perf_counter())))
    assert parent is not None
    t0 = time.perf_counter()
    worker.hold("ok", parent)
    worker.hold("bad", parent)
    worker.transfer_ended(TransferTiming("ok", t0 + 0.02, t0 + 0.03, True, t0, 4096))
    worker.transfer_ended(TransferTiming("bad", t0 + 0.02, t0 + 0.5, False, t0, 0))
    worker.transfer_ended(TransferTiming("never-held", t0, t0, True, t0, 1))  # an untraced request: nothing
    spans = {_attr(s, "tandem.request_id"): s for s in exporter.get_finished_spans()}
    assert set(spans) == {"ok", "bad"}
    assert {k: _attr(spans["ok"], k) for k in ("tandem.kv.bytes", "tandem.kv.backend", "tandem.kv.ok")} == {
        "tandem.kv.bytes": 4096, "tandem.kv.backend": "nixl", "tandem.kv.ok": True}
    assert _attr(spans["bad"], "tandem.kv.ok") is False
    assert all(s.name == "prefill_worker.kv_transfer" for s in spans.values())


def test_parents_held_for_requests_that_never_end_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    router, worker, exporter = _tracers()
    parent = worker.parent(router.metadata(router.begin(time.perf_counter())))
    assert parent is not None
    monkeypatch.setattr(tracing, "MAX_HELD", 3)
    for i in range(5):
        worker.hold(f"r{i}", parent, time.perf_counter())
    for i in range(5):
        worker.landed(f"r{i}", True)
    assert sorted(_attr(s, "tandem.request_id") for s in exporter.get_finished_spans()) == ["r2", "r3", "r4"]
