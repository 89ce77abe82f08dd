"""The router's client gRPC API (``tandem.v1.Gateway``) as ``python -m router.serve --grpc-port`` serves it, in
front of a fake worker (``bench.fake_worker``: the real worker API answering canned tokens) on loopback.

The engine is not involved here; ``tests/test_tandem_up.py`` checks the same API against real workers and
transformers. This file checks the standalone router's wiring, streaming and status codes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from router.grpc_gateway import completions_body, status_for
from router.serve import ReadyProcess


@pytest.fixture(scope="module")
def stub(checkpoint: Callable[[str], Path]) -> Iterator[gpb_grpc.GatewayStub]:
    fake = ReadyProcess.start("fake", [sys.executable, "-m", "bench.fake_worker", "--port", "0", "--tokens", "6"])
    router = None
    try:
        router = ReadyProcess.start("router", [sys.executable, "-m", "router.serve", "--model",
                                               str(checkpoint("llama")), "--workers", f"127.0.0.1:{fake.port}",
                                               "--port", "0", "--grpc-port", "0"])
        assert router.grpc_port > 0
        with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            yield gpb_grpc.GatewayStub(channel)
    finally:
        if router is not None:
            assert router.stop() == 0, router.tail()
        fake.stop()


def test_complete_streams_every_token_once_then_usage(stub: gpb_grpc.GatewayStub,
                                                      checkpoint: Callable[[str], Path]) -> None:
    """A text prompt streams the worker's tokens one chunk each, in order; the last chunk finishes with usage."""
    chunks = list(stub.Complete(gpb.CompleteRequest(model=checkpoint("llama").name, text="Hello there",
                                                    max_tokens=6), timeout=30))
    assert [t for c in chunks for t in c.token_ids] == list(range(300, 306))
    assert len(chunks) == 6 and [c.finish_reason for c in chunks] == [""] * 5 + ["length"]
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens > 0
    assert len({c.request_id for c in chunks}) == 1


def test_unknown_model_and_bad_fields_get_their_status(stub: gpb_grpc.GatewayStub,
                                                       checkpoint: Callable[[str], Path]) -> None:
    model = checkpoint("llama").name
    for request, code in ((gpb.CompleteRequest(model="other", text="x"), grpc.StatusCode.NOT_FOUND),
                          (gpb.CompleteRequest(model=model, text="x", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
                          (gpb.CompleteRequest(model=model, text="x", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
                          (gpb.CompleteRequest(model=model, token_ids=gpb.PromptTokens(ids=[10**6])),
                           grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Complete(request, timeout=30))
        assert e.value.code() == code and e.value.details()
    assert [m.id for m in stub.Models(gpb.ModelsRequest(), timeout=10).models] == [model]


def test_request_maps_onto_the_completions_body_leaving_unset_fields_out() -> None:
    """Only what the client set reaches the shared validation, so unset fields take the OpenAI defaults; HTTP
    statuses map onto gRPC codes."""
    r = gpb.CompleteRequest(model="m", token_ids=gpb.PromptTokens(ids=[1, 2]), temperature=0.0, stop=["\n"],
                            seed=7, ignore_eos=True)
    assert completions_body(r) == {"model": "m", "stream": True, "prompt": [1, 2], "temperature": 0.0, "seed": 7,
                                   "stop": ["\n"], "ignore_eos": True}
    assert completions_body(gpb.CompleteRequest(model="m", text="hi")) == {"model": "m", "stream": True,
                                                                           "prompt": "hi"}
    assert [status_for(s) for s in (400, 404, 413, 429, 500, 503)] == [
        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE]
