"""Tracing across processes: the router sends each request's W3C trace context to the workers, and workers started
with ``--otlp-endpoint`` add their spans under it (worker/tracing.py). Real prefill and decode worker processes and
the router all export over OTLP/gRPC to a small collector this test serves on 127.0.0.1 (the OpenTelemetry proto
package's ``TraceService``, which stores what it is sent): one disaggregated request is one trace holding the
router's phases and the workers' prefill, KV transfer (bytes and backend), KV landing and decode. ``tandem up
--otlp-endpoint`` hands the flag to the workers the controller starts: the same trace comes from a real cluster."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from test_tandem_up import Cluster

from router.server import RouterConfig
from router.tracing import RequestTracer
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
WORKER_SPANS = {"prefill_worker.prefill", "prefill_worker.kv_transfer", "decode_worker.kv_landing",
                "decode_worker.decode"}


class Collector(tgrpc.TraceServiceServicer):
    """Keeps every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: tpb.ExportTraceServiceRequest, context: Any) -> tpb.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                self.spans.extend((service, s) for ss in rs.scope_spans for s in ss.spans)
        return tpb.ExportTraceServiceResponse()

    def named(self) -> dict[str, tuple[str, Any]]:
        with self.lock:
            return {s.name: (service, s) for service, s in self.spans}


def _serve(collector: Collector) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    tgrpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _wait_for(collector: Collector, names: set[str], timeout_s: float) -> dict[str, tuple[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while not names <= set(collector.named()) and time.monotonic() < deadline:
        time.sleep(0.1)
    spans = collector.named()
    assert names <= set(spans), sorted(spans)
    return spans


@pytest.fixture(scope="module")
def traced(checkpoint: Callable[[str], Path]) -> Iterator[tuple[RouterThread, Collector]]:
    collector = Collector()
    server, endpoint = _serve(collector)
    model = str(checkpoint("llama"))
    workers: list[WorkerProcess] = []
    rt = None
    provider = TracerProvider(resource=Resource.create({"service.name": "tandem-router"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    try:
        workers = [start_worker(role, model, "tcp", [*WORKER_FLAGS, "--worker-id", f"trw-{role}",
                                                     "--otlp-endpoint", endpoint],
                                env={"OTEL_BSP_SCHEDULE_DELAY": "100"})  # export within 0.1 s, not 5 s
                   for role in ("prefill", "decode")]
        rt = RouterThread(RouterConfig(model=model, workers=tuple(w.address for w in workers), min_uncached_tokens=32))

        def attach(router: object) -> None:
            router.gateway.tracer = RequestTracer(provider)  # type: ignore[attr-defined]

        rt.call(attach)
        yield rt, collector
    finally:
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()
        provider.shutdown()
        server.stop(None)


def test_one_disaggregated_request_is_one_trace_across_router_prefill_kv_transfer_and_decode(
        traced: tuple[RouterThread, Collector]) -> None:
    rt, collector = traced
    body = {"prompt": "a long prompt that the router sends through prefill first " * 8, "max_tokens": 8,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=rt.url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        with c.stream("POST", "/v1/completions", json={**body, "model": model}) as r:
            assert r.status_code == 200
            assert list(r.iter_lines())
    want = WORKER_SPANS | {"tandem.request", "prefill", "kv_transfer", "decode"}
    spans = _wait_for(collector, want, 30)
    assert len({s.trace_id for _, s in collector.spans}) == 1  # one request, one trace
    _, root = spans["tandem.request"]
    assert not root.parent_span_id
    for name in want - {"tandem.request"}:
        service, s = spans[name]
        assert s.parent_span_id == root.span_id, name  # every phase hangs off the router's root span
        assert service == {"prefill_worker": "tandem-worker-prefill", "decode_worker": "tandem-worker-decode"}.get(
            name.split(".")[0], "tandem-router"), name
    attrs = {a.key: a.value for a in spans["prefill_worker.kv_transfer"][1].attributes}
    assert attrs["tandem.kv.backend"].string_value == "tcp" and attrs["tandem.kv.ok"].bool_value
    assert attrs["tandem.kv.bytes"].int_value > 0
    assert {a.key: a.value for a in spans["decode_worker.decode"][1].attributes}["tandem.tokens_sent"].int_value == 7
    slack_ns = 50_000_000  # wall clocks of three processes on one host, read through perf_counter offsets
    for name in WORKER_SPANS:
        s = spans[name][1]
        assert root.start_time_unix_nano - slack_ns <= s.start_time_unix_nano <= s.end_time_unix_nano, name
        assert s.end_time_unix_nano <= root.end_time_unix_nano + slack_ns, name
    prefill, transfer = spans["prefill_worker.prefill"][1], spans["prefill_worker.kv_transfer"][1]
    assert transfer.start_time_unix_nano <= prefill.end_time_unix_nano  # layer-wise: it starts during the prefill


def test_tandem_up_hands_the_otlp_endpoint_to_its_workers(checkpoint: Callable[[str], Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    collector = Collector()
    server, endpoint = _serve(collector)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the router's and (through Ray) the workers' batches
    cluster = Cluster(checkpoint("llama"), tmp_path / "home", ("--otlp-endpoint", endpoint))
    try:
        body = {"prompt": "a long shared context about serving " * 20, "max_tokens": 4, "ignore_eos": True}
        with httpx.Client(base_url=cluster.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            assert c.post("/v1/completions", json={**body, "model": model}).status_code == 200
        spans = _wait_for(collector, WORKER_SPANS | {"tandem.request"}, 60)
        root = spans["tandem.request"][1]
        assert {a.key: a.value.string_value for a in root.attributes}["tandem.mode"] == "disaggregated"
        for name in WORKER_SPANS:
            assert spans[name][1].trace_id == root.trace_id and spans[name][1].parent_span_id == root.span_id, name
    finally:
        assert cluster.stop() == 0
        server.stop(None)
