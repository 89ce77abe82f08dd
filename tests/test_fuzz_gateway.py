"""Fuzzing the gateway (issue 24 §12): Hypothesis-generated bodies on ``/v1/completions`` and
``/v1/chat/completions``, 500 cases each (valid-looking bodies, the same with one field, known or not, set to any
JSON value, any JSON document, bytes that are not JSON), never get a 5xx nor a server error inside a stream;
afterwards the server is healthy and the worker holds no block. Raw-socket cases against the same gateway:
slowloris, an incomplete body, conflicting ``Content-Length`` and ``Transfer-Encoding``, HTTP/1.0 and pipelining.
One real ``tandem worker`` (colocated) behind an in-process router; generations are a few tokens long, so that the
1,000 cases take a minute or so."""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread, wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.asgi import HTTPConfig
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
CASES = 500  # per endpoint

_json = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) |
                     st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                     lambda inner: (st.lists(inner, max_size=4) |
                                    st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=8)


_SAMPLING: dict[str, st.SearchStrategy[Any]] = {  # values in range, mostly
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 1 << 31),
    "n": st.integers(1, 2),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 500), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "logit_bias": st.dictionaries(st.integers(0, 500).map(str), st.floats(-100, 100), max_size=3),
    "user": st.text(max_size=8),
}
_COMPLETIONS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 500), min_size=1, max_size=12)),
    "echo": st.booleans(), "logprobs": st.integers(0, 5), "best_of": st.integers(1, 2)}
_CONTENT = st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=3))
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                  "content": _CONTENT})
_CHAT: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(_MESSAGE, min_size=1, max_size=3), "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5), "response_format": st.just({"type": "text"})}
_ANY_FIELD = st.sampled_from(sorted({*_SAMPLING, *_COMPLETIONS, *_CHAT, "model", "stream_options", "tools",
                                     "suffix", "response_format", "max_completion_tokens", "unknown_field"}))


def _bodies(own: dict[str, st.SearchStrategy[Any]], model: str) -> st.SearchStrategy[Any]:
    """Valid-looking bodies (the endpoint's required fields and any in-range sampling fields), the same with one
    field set to any JSON value, any JSON document, and bytes that are not JSON."""
    required = next(k for k in ("prompt", "messages") if k in own)
    optional = {k: v for k, v in {**own, **_SAMPLING}.items() if k != required}
    plausible = st.builds(lambda req, opt: {"model": model, required: req, **opt}, own[required],
                          st.fixed_dictionaries({}, optional=optional))  # type: ignore[arg-type]
    corrupted = st.builds(lambda body, key, value: {**body, key: value}, plausible, _ANY_FIELD, _json)
    return st.one_of(plausible, plausible, corrupted, corrupted, _json, st.binary(max_size=40))


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path]) -> Iterator[WorkerProcess]:
    w = start_worker("decode", str(checkpoint("llama")), "tcp", [*WORKER_FLAGS, "--worker-id", "fuzz-0"])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def router(worker: WorkerProcess, checkpoint: Callable[[str], Path]) -> Iterator[RouterThread]:
    rt = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=(worker.address,),
                                   http=HTTPConfig(header_read_timeout_s=1.0, body_read_timeout_s=1.0)))
    yield rt
    rt.stop()


def _bounded(body: Any) -> Any:
    """Keep a generated request short: a valid one without ``max_tokens`` would generate up to the context."""
    if isinstance(body, dict) and not isinstance(body.get("max_tokens"), int):
        body = {**body, "max_tokens": 3}
    return body


def _check(client: httpx.Client, path: str, body: Any, seen: Counter[int]) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(_bounded(body)).encode()  # big ints too
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        data = r.read()
    seen[r.status_code] += 1
    assert r.status_code < 500, (path, raw[:300], r.status_code, data[:300])
    assert b'"server_error"' not in data, (path, raw[:300], data[:300])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generated_requests_never_get_a_5xx(router: RouterThread, worker: WorkerProcess,
                                           checkpoint: Callable[[str], Path], path: str) -> None:
    model = checkpoint("llama").name
    own = _CHAT if path.endswith("chat/completions") else _COMPLETIONS
    t0 = time.monotonic()
    seen: Counter[int] = Counter()
    with httpx.Client(base_url=router.url, timeout=60) as client:
        @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(body=_bodies(own, model))
        def case(body: Any) -> None:
            _check(client, path, body, seen)

        case()
    print(f"\n{sum(seen.values())} cases on {path} in {time.monotonic() - t0:.1f} s: {dict(seen)}")
    assert sum(seen.values()) >= CASES and seen[200] >= CASES // 20  # some of them reach the worker
    assert httpx.get(router.url + "/health", timeout=30).status_code == 200
    loads = wait_idle([worker])
    assert all(ld.used_blocks == 0 and ld.running == 0 for ld in loads), loads


def _raw(router: RouterThread, data: bytes, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection; everything the server answers until it closes, and how long it took."""
    s = socket.create_connection(("127.0.0.1", router.port), timeout=limit_s)
    t0 = time.monotonic()
    s.sendall(data)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    finally:
        s.close()
    return out, time.monotonic() - t0


def test_raw_socket_cases_on_the_gateway(router: RouterThread, checkpoint: Callable[[str], Path]) -> None:
    model = checkpoint("llama").name
    out, took = _raw(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-a: 1\r\n")  # slowloris: head never ends
    assert out == b"" and took < 5.0
    out, took = _raw(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"model\"")
    assert out.startswith(b"HTTP/1.1 408") and took < 5.0  # incomplete body
    body = orjson.dumps({"model": model, "prompt": [5, 6], "max_tokens": 1})
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    out, _ = _raw(router, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n%b" % (len(body), len(body), body, smuggled))
    assert out.startswith(b"HTTP/1.1 200") and out.count(b"HTTP/1.1") == 1  # chunked wins; nothing smuggled
    out, _ = _raw(router, b"GET /health HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.0 200") and b'"status":"ok"' in out
    out, _ = _raw(router, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 3 + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                  b"Connection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200") == 4 and out.rindex(b'"status"') < out.index(b'"object":"list"')
