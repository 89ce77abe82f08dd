"""Routing over real worker processes: KV-aware placement, load spreading, mid-stream migration, and two router
replicas sharing one index through a real redis-server.

Routers run in-process (their own asyncio loop on a thread, serving HTTP on loopback); workers are real
``tandem worker`` processes; redis-server is started by the test and stopped by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from gateway_harness import RouterThread, routed_worker

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.selector import Selector
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "512", "--threads", "1"]


def complete(url: str, model: str, prompt: list[int], max_tokens: int = 4, **kw: Any) -> tuple[dict[str, Any], str]:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True, **kw},
                   headers={"x-tandem-explain": "1"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json(), r.headers["x-tandem-route"]


@pytest.fixture(scope="module")
def two_workers(checkpoint: Callable[[str], Path]) -> Iterator[list[WorkerProcess]]:
    path = str(checkpoint("llama"))
    workers = [start_worker("decode", path, "tcp", [*FLAGS, "--worker-id", f"dec-{i}"]) for i in range(2)]
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def router(two_workers: list[WorkerProcess], checkpoint: Callable[[str], Path]) -> Iterator[RouterThread]:
    rt = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=tuple(w.address for w in two_workers)))
    yield rt
    rt.stop()


def test_repeated_long_prefix_goes_to_the_worker_that_holds_it(router: RouterThread,
                                                                checkpoint: Callable[[str], Path]) -> None:
    """After one request caches a 192-token prefix, every request sharing it lands on that worker, cache-hit."""
    model = checkpoint("llama").name
    rng = random.Random(11)
    prefix = [rng.randrange(2000) for _ in range(192)]
    _, header = complete(router.url, model, [*prefix, 1, 2, 3])
    holder = routed_worker(header)
    from engine.block_hash import extra_keys_for, hash_blocks

    hashes = hash_blocks(prefix, 16, extra_keys_for(model=model))
    deadline = time.monotonic() + 15  # KV events reach the index asynchronously
    while router.call(lambda r: r.index.match(hashes)).get(holder, 0) < len(hashes):
        assert time.monotonic() < deadline, "the holder's KV events never reached the router's index"
        time.sleep(0.05)
    for i in range(6):
        body, header = complete(router.url, model, [*prefix, *(rng.randrange(2000) for _ in range(5 + i))])
        assert routed_worker(header) == holder, header
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 176


def test_load_spreads_within_20_percent_without_prefix_reuse(router: RouterThread,
                                                             checkpoint: Callable[[str], Path]) -> None:
    """60 unrelated prompts, 6 at a time: each of the two workers gets within 20% of half."""
    model = checkpoint("llama").name
    rng = random.Random(12)
    prompts = [[rng.randrange(2000) for _ in range(rng.randrange(20, 120))] for _ in range(60)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as ex:
        routes = list(ex.map(lambda p: routed_worker(complete(router.url, model, p, 2)[1]), prompts))
    counts = Counter(routes)
    assert set(counts) == {"dec-0", "dec-1"}
    for n in counts.values():
        assert abs(n - 30) <= 6, counts


def test_router_refuses_workers_that_hash_kv_blocks_differently(two_workers: list[WorkerProcess],
                                                                  checkpoint: Callable[[str], Path]) -> None:
    """Workers report their block size and hash keys in Health; a router hashing prompts another way would never
    match their KV events, so it refuses to start and names the field, instead of routing blind."""
    with pytest.raises(ValueError, match=r"block_size 16 != router's 32"):
        RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=tuple(w.address for w in two_workers),
                                  block_size=32))


def test_worker_killed_mid_stream_migrates_and_the_client_sees_an_exact_stream(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """SIGKILL the decode worker serving a stream: the router resubmits prompt + tokens so far to the other
    worker, and the client receives exactly the greedy continuation, no token repeated or missing."""
    path = checkpoint("llama")
    workers = [start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", f"mig-{i}"]) for i in range(2)]
    rt = RouterThread(RouterConfig(model=str(path), workers=tuple(w.address for w in workers)))
    try:
        prompt = [7, 8, 9, 10, 11]
        ref = hf_greedy(path, prompt, 48)
        chunks: list[dict[str, Any]] = []
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=120, headers={"x-tandem-explain": "1"},
                          json={"model": path.name, "prompt": prompt, "max_tokens": 48, "temperature": 0,
                                "ignore_eos": True, "stream": True, "logprobs": 0}) as r:
            victim = routed_worker(r.headers["x-tandem-route"])
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 5:
                    next(w for w in workers if f"mig-{workers.index(w)}" == victim).kill()
        tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        from engine.tokenizer import Tokenizer

        assert text == Tokenizer(path).decode(ref)
        assert len(tokens) == 48
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert rt.call(lambda r: r.dispatcher.stats.migrations) == 1
    finally:
        rt.stop()
        for w in workers:
            w.stop()


def test_router_processes_started_by_a_supervisor_get_every_routing_flag() -> None:
    """``router.serve --processes N`` has granian start N worker processes, each building its router from the flags
    it is handed: each must route as the parent was told to (a router on the default block size would refuse
    workers on another, and one on the default dead-after would wait longer than asked)."""
    import argparse

    from router.serve import add_router_args, child_argv

    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(["--model", "/m", "--workers", "127.0.0.1:1", "--processes", "2", "--block-size", "32",
                         "--worker-dead-after", "3.5", "--min-uncached-tokens", "7", "--api-key", "admin:k",
                         "--max-requests-per-decode-worker", "9"])
    child = p.parse_args(child_argv(args, 8123, None))
    assert (child.block_size, child.worker_dead_after, child.min_uncached_tokens) == (32, 3.5, 7)
    assert (child.port, child.processes, child.api_key, child.max_requests_per_decode_worker) == (
        8123, 1, ["admin:k"], 9)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_stopped_worker_is_cut_off_and_its_stream_migrates_exactly(
        mode: str, checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """SIGSTOP, not SIGKILL, the decode worker serving a stream: its connections stay open and nothing more comes
    back, as from a host that froze or a network that partitioned. The router's probes go unanswered; after
    ``worker_dead_after_s`` (1 s here) it cuts the worker off, the stream (the colocated session, or the
    disaggregated Decode call) fails over, and the client still gets exactly the greedy continuation, in seconds
    rather than the request's 300 s deadline. Once the worker is continued, it finds those streams closed and
    frees every block."""
    path = checkpoint("llama")
    decodes = [start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", f"stop-{i}"]) for i in range(2)]
    prefill = (start_worker("prefill", str(path), "tcp", [*FLAGS, "--worker-id", "stop-pre"])
               if mode == "disaggregated" else None)
    addresses = (*(w.address for w in decodes), *([prefill.address] if prefill else []))
    rt = RouterThread(RouterConfig(model=str(path), workers=addresses, worker_dead_after_s=1.0))
    victim: WorkerProcess | None = None
    try:
        rng = random.Random(33)
        prompt = [7, 8, 9, 10, 11] if mode == "colocated" else [rng.randrange(2000) for _ in range(160)]
        n = 200
        ref = hf_greedy(path, prompt, n)
        chunks: list[dict[str, Any]] = []
        stopped_at = 0.0
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=120, headers={"x-tandem-explain": "1"},
                          json={"model": path.name, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            route = r.headers["x-tandem-route"]
            assert ("prefill[" in route) == (mode == "disaggregated"), route
            victim = decodes[int(routed_worker(route).split("-")[1])]
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 5:
                    os.kill(victim.proc.pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        took = time.monotonic() - stopped_at
        from engine.tokenizer import Tokenizer

        assert "".join(c["choices"][0]["text"] for c in chunks) == Tokenizer(path).decode(ref)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert rt.call(lambda r: r.dispatcher.stats.migrations) == 1
        assert took < 15, f"the stream took {took:.1f}s to fail over"
        assert rt.call(lambda r: r.pool.workers[victim.address].cut_off)
        os.kill(victim.proc.pid, signal.SIGCONT)
        with grpc.insecure_channel(victim.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            deadline = time.monotonic() + 30
            while True:
                ld = stub.Load(pb.LoadRequest(), timeout=10)
                if ld.used_blocks == 0 and ld.running == 0 and ld.waiting == 0 and ld.waiting_for_kv == 0:
                    break
                assert time.monotonic() < deadline, f"the stopped worker kept requests or blocks: {ld}"
                time.sleep(0.1)
        deadline = time.monotonic() + 10
        while rt.call(lambda r: r.pool.workers[victim.address].cut_off):  # it answers again: used again
            assert time.monotonic() < deadline, "the continued worker was not taken back"
            time.sleep(0.1)
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.proc.pid, signal.SIGCONT)
        rt.stop()
        for w in (*decodes, *([prefill] if prefill else [])):
            w.stop()


def test_worker_killed_mid_answer_migrates_a_non_streamed_request_exactly(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """The same for an answer sent whole (the gateway's collect path, chunks handed to it as they arrive): once
    the router holds part of the answer, its decode worker is SIGKILLed; the request continues on the other
    worker from the tokens already received, and the single answer is exactly transformers' greedy text."""
    path = checkpoint("llama")
    workers = [start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", f"migc-{i}"]) for i in range(2)]
    rt = RouterThread(RouterConfig(model=str(path), workers=tuple(w.address for w in workers)))
    try:
        prompt, n = [12, 13, 14], 400
        ref = hf_greedy(path, prompt, n)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(zip(("body", "route"),
                                                           complete(rt.url, path.name, prompt, max_tokens=n),
                                                           strict=True)))
        t.start()
        deadline = time.monotonic() + 60
        while rt.call(lambda r: r.gateway.metrics.generation_tokens.value) == 0:  # part of the answer is in
            assert time.monotonic() < deadline and t.is_alive(), "no tokens arrived"
            time.sleep(0.002)
        busy = rt.call(lambda r: [a for a, w in r.pool.workers.items() if w.session and w.session.in_flight])
        assert len(busy) == 1
        next(w for w in workers if w.address == busy[0]).kill()
        t.join(120)
        from engine.tokenizer import Tokenizer

        body = out["body"]
        assert body["choices"][0]["text"] == Tokenizer(path).decode(ref)
        assert body["usage"]["completion_tokens"] == n and body["choices"][0]["finish_reason"] == "length"
        assert rt.call(lambda r: (r.dispatcher.stats.migrations, r.dispatcher.stats.retries)) == (1, 0)
        assert out["route"].count(" | ") == 1  # two plans: the first worker, then the other
    finally:
        rt.stop()
        for w in workers:
            w.stop()


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_two_router_replicas_on_one_redis_build_identical_indexes(redis_url: str,
                                                                   checkpoint: Callable[[str], Path]) -> None:
    """Workers publish KV events to one Redis stream; two routers discover the workers from their leases and
    consume the stream into indexes that are equal, even though only one router sent traffic."""
    path = checkpoint("llama")
    workers = [start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", f"rd-{i}", "--redis", redis_url])
               for i in range(2)]
    routers = [RouterThread(RouterConfig(model=str(path), workers=(), redis=redis_url)) for _ in range(2)]
    try:
        deadline = time.monotonic() + 20
        while any(len(r.call(lambda x: x.pool.available("decode"))) < 2 for r in routers):
            assert time.monotonic() < deadline, "routers did not discover both workers"
            time.sleep(0.1)
        rng = random.Random(13)
        for _ in range(12):
            complete(routers[0].url, path.name, [rng.randrange(2000) for _ in range(rng.randrange(40, 160))])
        deadline = time.monotonic() + 20
        while True:
            a, b = (r.call(lambda x: x.index.snapshot()) for r in routers)
            if a == b and len(routers[1].call(lambda x: x.index)) > 0:
                break
            assert time.monotonic() < deadline, "indexes did not converge"
            time.sleep(0.1)
        assert {w for w, _, _ in a.workers} == {"rd-0", "rd-1"} or len(a.workers) >= 1
        # A worker that dies stops renewing its lease and disappears from both routers.
        workers[1].kill()
        deadline = time.monotonic() + 15
        while any(len(r.call(lambda x: x.pool.workers)) != 1 for r in routers):
            assert time.monotonic() < deadline, "dead worker's lease did not expire"
            time.sleep(0.1)
    finally:
        for r in routers:
            r.stop()
        for w in workers:
            w.stop()


def _wait_idle(workers: list[WorkerProcess], timeout_s: float) -> list[Any]:
    """Poll the workers until none runs, queues or holds a block for a request; return the last loads."""
    from proto.tandem.v1 import worker_pb2 as pb
    from router.handoff import WorkerClient

    clients = [WorkerClient.connect(w.address) for w in workers]
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            loads = [c.stub.Load(pb.LoadRequest(), timeout=5) for c in clients]
            if all(ld.running == 0 and ld.waiting == 0 and ld.used_blocks == 0 for ld in loads):
                return loads
            if time.monotonic() > deadline:
                return loads
            time.sleep(0.05)
    finally:
        for c in clients:
            c.close()


def test_client_that_goes_away_mid_stream_is_aborted_on_its_worker(router: RouterThread,
                                                                    two_workers: list[WorkerProcess],
                                                                    checkpoint: Callable[[str], Path]) -> None:
    """An SSE client that closes its connection, and a gRPC client that cancels its call, after a few tokens of a
    4000-token completion: the worker serving it stops the request and holds no block for it within 3 s, where
    finishing the completion would take several seconds more (the tiny model decodes under 1k tokens/s here)."""
    import grpc

    from proto.tandem.v1 import gateway_pb2 as gpb
    from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
    from router.grpc_gateway import start_grpc_gateway

    model = checkpoint("llama").name
    assert all(ld.running == 0 for ld in _wait_idle(two_workers, 30))
    body = {"model": model, "prompt": list(range(40, 60)), "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping an unfinished iter_lines() closes the response (a disconnect too)
        seen = 0
        for line in lines:
            seen += line.startswith("data: {")
            if seen >= 3:
                break
        live = _wait_idle(two_workers, 0)
        assert sum(ld.running for ld in live) == 1, live  # still generating while connected
    # Leaving the block closes the connection mid-stream.
    loads = _wait_idle(two_workers, 3.0)
    assert all(ld.running == 0 and ld.used_blocks == 0 for ld in loads), loads

    assert router.router is not None
    server, port = asyncio.run_coroutine_threadsafe(start_grpc_gateway(router.router.gateway, "127.0.0.1", 0),
                                                    router.loop).result(30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = gpb_grpc.GatewayStub(channel).Complete(gpb.CompleteRequest(
                model=model, token_ids=gpb.PromptTokens(ids=list(range(60, 80))), max_tokens=4000,
                temperature=0.0, ignore_eos=True), timeout=60)
            stream = iter(call)
            for _ in range(3):
                assert next(stream).token_ids
            assert sum(ld.running for ld in _wait_idle(two_workers, 0)) == 1
            call.cancel()
            with pytest.raises(grpc.RpcError):
                for _ in stream:
                    pass
        loads = _wait_idle(two_workers, 3.0)
        assert all(ld.running == 0 and ld.used_blocks == 0 for ld in loads), loads
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1.0), router.loop).result(30)


def test_client_that_goes_away_before_a_whole_answer_is_aborted_on_its_worker(
        router: RouterThread, two_workers: list[WorkerProcess], checkpoint: Callable[[str], Path]) -> None:
    """The same for a non-streamed request (the ASGI app's disconnect watcher cancels its handler while it waits
    for the whole answer): the worker stops it and frees its blocks."""
    model = checkpoint("llama").name
    assert all(ld.running == 0 for ld in _wait_idle(two_workers, 30))
    body = json.dumps({"model": model, "prompt": list(range(90, 110)), "max_tokens": 4000, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        deadline = time.monotonic() + 10
        while sum(ld.running for ld in _wait_idle(two_workers, 0)) != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    loads = _wait_idle(two_workers, 3.0)
    assert all(ld.running == 0 and ld.used_blocks == 0 for ld in loads), loads
    assert router.call(lambda r: sum(cast(Selector, s).booked() for s in (r.dispatcher.decode_selector,
                                                                          r.dispatcher.prefill_selector))) == 0


def test_overload_and_no_worker_get_429_and_503_with_retry_after(router: RouterThread,
                                                                 checkpoint: Callable[[str], Path]) -> None:
    """A queue past the admission limit is 429 and a router with no live decode worker is 503, both OpenAI-style
    errors with a Retry-After header; once the queue is back under the limit the same request is served. (The
    router's count of requests in flight is raised past the admission limit rather than flooding the workers.)"""
    model = checkpoint("llama").name
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
    router.call(lambda r: setattr(r.gateway.admission, "in_flight", r.gateway.admission.in_flight + 100_000))
    try:
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and "overloaded" in r.json()["error"]["message"]
    finally:
        router.call(lambda r: setattr(r.gateway.admission, "in_flight", r.gateway.admission.in_flight - 100_000))
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200

    lone = start_worker("decode", str(checkpoint("llama")), "tcp", [*FLAGS, "--worker-id", "lone"])
    lonely = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=(lone.address,)))
    try:
        lone.kill()  # the router's only worker dies
        deadline = time.monotonic() + 15
        while lonely.call(lambda r: r.pool.available("decode")):
            assert time.monotonic() < deadline, "the router never noticed its worker died"
            time.sleep(0.05)
        r = httpx.post(lonely.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "no decode worker" in r.json()["error"]["message"]
        assert httpx.get(lonely.url + "/health", timeout=10).status_code == 503
    finally:
        lonely.stop()
        lone.stop()


def test_prefill_worker_dead_at_dispatch_is_retried_on_the_other_with_the_exact_answer(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """Two prefill workers and one decode worker. One prefill worker is SIGKILLed while the router still counts
    it healthy (its health poll and event follower for that worker are stopped first: otherwise the router notices
    a death within milliseconds, and this would race it), and the other is booked busy in the router's load
    tracker, so the dead one is the cheapest and is picked. Its Prefill call fails, the request moves to the live
    prefill worker (a retry, not a migration: no token was out yet), and the client gets the exact greedy answer."""
    path = checkpoint("llama")
    prefills = [start_worker("prefill", str(path), "tcp", [*FLAGS, "--worker-id", f"pre-{i}"]) for i in range(2)]
    decode = start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", "dec-r"])
    rt = RouterThread(RouterConfig(model=str(path), workers=(*(w.address for w in prefills), decode.address)))
    try:
        rt.call(lambda r: cast(Selector, r.dispatcher.prefill_selector).load.on_dispatch("pre-1", 50_000, 0))
        rt.call(lambda r: [t.cancel() for t in r.pool.workers[prefills[0].address].tasks])
        prompt = [random.Random(21).randrange(2000) for _ in range(160)]
        prefills[0].kill()
        assert rt.call(lambda r: r.pool.workers[prefills[0].address].healthy)
        body, header = complete(rt.url, path.name, prompt, max_tokens=6)
        from engine.tokenizer import Tokenizer

        assert body["choices"][0]["text"] == Tokenizer(path).decode(hf_greedy(path, prompt, 6))
        stats = rt.call(lambda r: (r.dispatcher.stats.retries, r.dispatcher.stats.migrations))
        assert stats == (1, 0), (stats, header)
        first, last = header.split(" | ")[0], header.split(" | ")[-1]
        assert "prefill[w=pre-0" in first and "prefill[w=pre-1" in last, header
    finally:
        rt.stop()
        for w in (*prefills, decode):
            w.stop()
