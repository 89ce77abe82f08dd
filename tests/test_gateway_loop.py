"""The router's event loop never blocks on one request's input (issue 24 §3): a prompt over the byte cap is
refused with 413 before it is tokenised, large bodies are parsed and tokenised in the parser threads, and while an
8 MB prompt is being refused ``/health`` and a concurrent stream each answer within 100 ms. One real ``tandem
worker`` (colocated) behind an in-process router."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread

from router.asgi import HTTPConfig
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
BOUND_S = 0.100


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path]) -> Iterator[WorkerProcess]:
    w = start_worker("decode", str(checkpoint("llama")), "tcp", [*WORKER_FLAGS, "--worker-id", "loop-0"])
    yield w
    w.stop()


def _probe_while(url: str, model: str, busy: threading.Thread) -> tuple[list[float], list[float]]:
    """While ``busy`` runs: ``/health`` round trips and a short stream's whole answers, in seconds."""
    health: list[float] = []
    streams: list[float] = []
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/health")  # the connection is open before the clock starts
        deadline = time.monotonic() + 120
        while (busy.is_alive() or not health) and time.monotonic() < deadline:
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            health.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                assert b"[DONE]" in r.read()
            streams.append(time.perf_counter() - t0)
    return health, streams


def _probe_once(url: str, model: str) -> None:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()


def _refuse_big_prompt(url: str, model: str, size: int, out: list[httpx.Response]) -> threading.Thread:
    """Send a prompt of ``size`` bytes of words from a thread; the body is encoded before the clock starts (the
    client shares this process, and so its GIL, with the router)."""
    words = [f"w{i % 977} " for i in range(size // 5 + 1)]
    body = orjson.dumps({"model": model, "prompt": "".join(words)[:size], "max_tokens": 1})

    def send() -> None:
        out.append(httpx.post(url + "/v1/completions", content=body, timeout=120,
                              headers={"content-type": "application/json"}))

    t = threading.Thread(target=send)
    t.start()
    return t


@pytest.mark.parametrize("tokenised", [False, True], ids=["8mb-over-byte-cap-413", "256kb-tokenised-off-loop-400"])
def test_health_and_a_stream_answer_within_100ms_while_a_big_prompt_is_refused(
        worker: WorkerProcess, checkpoint: Callable[[str], Path], tokenised: bool) -> None:
    """Over the byte cap the 8 MB prompt gets 413 before tokenisation (the JSON is parsed and its prompt measured
    in a parser thread); in the second case a 256 kB prompt under the cap is tokenised in a parser thread and
    refused as longer than the context. Either way the loop answers the others meanwhile."""
    model = checkpoint("llama").name
    cfg = RouterConfig(model=str(checkpoint("llama")), workers=(worker.address,),
                       http=HTTPConfig(max_body_bytes=32 << 20),
                       max_prompt_bytes=2 << 20)
    rt = RouterThread(cfg)
    try:
        answers: list[httpx.Response] = []
        _probe_once(rt.url, model)  # the worker's session is open and warm before the clock starts
        busy = _refuse_big_prompt(rt.url, model, 256_000 if tokenised else 8_000_000, answers)
        health, streams = _probe_while(rt.url, model, busy)
        busy.join(120)
        assert answers and answers[0].status_code == (400 if tokenised else 413), answers[0].text[:200]
        if tokenised:
            assert answers[0].json()["error"]["code"] == "context_length_exceeded"
        assert health and streams
        what = "256 kB prompt tokenised" if tokenised else "8 MB prompt over the cap"
        print(f"\n{what}: {len(health)} probes, /health max {max(health) * 1e3:.1f} ms, "
              f"stream max {max(streams) * 1e3:.1f} ms")
        assert max(health) < BOUND_S, health
        assert max(streams) < BOUND_S, streams
    finally:
        rt.stop()
