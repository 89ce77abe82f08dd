"""Opt-in request tracing (router/tracing.py): one disaggregated request through a router with real prefill and
decode worker processes yields one trace, a root span with ``prefill``, ``kv_transfer`` and ``decode`` children in
time order; a colocated one yields ``generate``. Spans go to the SDK's in-memory exporter (the OTLP exporter the
``--otlp-endpoint`` flag builds needs a collector, which is not run here; its construction is checked)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.server import RouterConfig
from router.tracing import RequestTracer, otlp_provider
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced(checkpoint: Callable[[str], Path]) -> Iterator[tuple[RouterThread, InMemorySpanExporter]]:
    model = str(checkpoint("llama"))
    workers: list[WorkerProcess] = []
    rt = None
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        workers = [start_worker(role, model, "tcp", [*WORKER_FLAGS, "--worker-id", f"tr-{role}"])
                   for role in ("prefill", "decode")]
        rt = RouterThread(RouterConfig(model=model, workers=tuple(w.address for w in workers), min_uncached_tokens=32))

        def attach(router: object) -> None:
            router.gateway.tracer = RequestTracer(provider)  # type: ignore[attr-defined]

        rt.call(attach)
        yield rt, exporter
    finally:
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()
        provider.shutdown()


def _complete(rt: RouterThread, prompt: str, stream: bool) -> None:
    body = {"model": "x", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=rt.url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/completions", json={**body, "model": model})
        assert r.status_code == 200, r.text


def _by_trace(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    out: dict[int, list[ReadableSpan]] = {}
    for s in spans:
        assert s.context is not None
        out.setdefault(s.context.trace_id, []).append(s)
    return out


def test_one_disaggregated_request_is_one_trace_router_prefill_kv_transfer_decode(
        traced: tuple[RouterThread, InMemorySpanExporter]) -> None:
    rt, exporter = traced
    exporter.clear()
    _complete(rt, "a long prompt that the router sends through prefill first " * 8, stream=True)
    (spans,) = _by_trace(exporter.get_finished_spans()).values()
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["decode", "kv_transfer", "prefill", "tandem.request"]
    root = by_name["tandem.request"]
    assert root.parent is None and root.attributes is not None
    assert root.attributes["tandem.mode"] == "disaggregated" and root.attributes["tandem.generated_tokens"] == 8
    phases = [by_name[n] for n in ("prefill", "kv_transfer", "decode")]
    for s in phases:
        assert s.parent is not None and root.context is not None and s.parent.span_id == root.context.span_id
        assert s.start_time is not None and s.end_time is not None and s.start_time <= s.end_time
    assert root.start_time is not None and root.end_time is not None
    assert root.start_time <= phases[0].start_time  # type: ignore[operator]
    assert phases[0].end_time == phases[1].start_time and phases[1].end_time == phases[2].start_time
    assert phases[2].end_time == root.end_time


def test_a_colocated_request_is_one_trace_with_a_generate_span(
        traced: tuple[RouterThread, InMemorySpanExporter]) -> None:
    rt, exporter = traced
    exporter.clear()
    _complete(rt, "short", stream=False)
    (spans,) = _by_trace(exporter.get_finished_spans()).values()
    assert sorted(s.name for s in spans) == ["generate", "tandem.request"]


def test_the_otlp_flag_builds_a_batching_otlp_exporter() -> None:
    provider = otlp_provider("127.0.0.1:4317", "tandem-test")
    try:
        assert provider.resource.attributes["service.name"] == "tandem-test"
        processors = provider._active_span_processor._span_processors
        assert [type(p).__name__ for p in processors] == ["BatchSpanProcessor"]
        assert type(processors[0].span_exporter).__name__ == "OTLPSpanExporter"  # type: ignore[attr-defined]
    finally:
        provider.shutdown()
