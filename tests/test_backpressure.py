"""Backpressure: a client that reads its SSE stream at 1 byte/s neither fills the router's memory nor keeps the
worker generating for it, and the other requests do not notice it.

A real ``tandem worker`` process behind an in-process router serving HTTP on loopback; the slow client is a raw
socket with a tiny receive buffer, read one byte a second for a bounded time. What piles up is bounded at each hop
(the socket buffers and the HTTP server's bounded body channel, then the router session's per-request buffer, then
the worker, which pauses the request: worker/parking.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from gateway_harness import RouterThread

from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.server import RouterConfig
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
MAX_TOKENS = 3000
READ_FOR_S = 40.0  # the slow reader's whole life: bounded


def _load(stub: pb_grpc.WorkerStub) -> pb.LoadResponse:
    return stub.Load(pb.LoadRequest(), timeout=10)


def _slow_reader(port: int, body: bytes, stop: threading.Event, got: list[int]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a tiny TCP window
        # A client across a network advertises an MSS of ~1.4 KB. Loopback's 64 KB MSS would start the server's
        # send buffer at ~4 MB (Linux sizes it from MSS x initial window), where the kernel alone would absorb
        # this whole answer and no process would ever see the client fall behind.
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1200)
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.settimeout(1.0)
        deadline = time.monotonic() + READ_FOR_S
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                got[0] += len(s.recv(1))
            stop.wait(1.0)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_1_byte_per_second_reader_is_paused_bounded_and_alone(
        mode: str, checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """The slow stream asks for 3000 tokens, on the decode worker's session (colocated) or on a Decode stream after
    a prefill worker's handoff (disaggregated). The decode worker generates a bounded number for it and then pauses
    it (Load.paused = 1, generated_tokens stops growing, far below 3000); the router holds at most a bounded number
    of its tokens; four other streams run meanwhile and come back exact and fast. When the slow client goes away,
    its request is aborted and every block is free."""
    path = checkpoint("llama")
    flags = ["--num-kv-blocks", "512", "--threads", "1"]
    w = start_worker("decode", str(path), "tcp", [*flags, "--stream-stall-timeout", "600"])
    pre = start_worker("prefill", str(path), "tcp", flags) if mode == "disaggregated" else None
    rt = RouterThread(RouterConfig(model=str(path), workers=(w.address, *([pre.address] if pre else []))))
    stop = threading.Event()
    got = [0]
    reader: threading.Thread | None = None
    try:
        with grpc.insecure_channel(w.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            base = _load(stub).generated_tokens
            prompt = list(range(11, 111 if pre else 16))  # long enough to be routed disaggregated, or short
            body = json.dumps({"model": path.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                               "ignore_eos": True, "stream": True}).encode()
            reader = threading.Thread(target=_slow_reader, args=(rt.port, body, stop, got), daemon=True)
            reader.start()
            # Wait until the worker has paused the slow request and its count has stopped growing.
            deadline = time.monotonic() + 30
            last, still_since = -1, time.monotonic()
            while time.monotonic() < deadline:
                ld = _load(stub)
                if ld.generated_tokens != last:
                    last, still_since = ld.generated_tokens, time.monotonic()
                elif ld.paused == 1 and time.monotonic() - still_since > 2.0:
                    break
                time.sleep(0.2)
            ld = _load(stub)
            slow_tokens = ld.generated_tokens - base
            assert ld.paused == 1, f"the slow request was never paused: {ld}"
            assert slow_tokens < MAX_TOKENS // 2, f"{slow_tokens} tokens generated for a client that reads nothing"

            def buffered(r: object) -> int:
                """Tokens the router's session holds for its requests (both paths: a disaggregated request's
                Decode travels the session too)."""
                session = r.pool.workers[w.address].session  # type: ignore[attr-defined]
                return max((p.buffered for p in session._pending.values()), default=0)

            limit = rt.call(lambda r: r.dispatcher.config.max_buffered_tokens)
            held = rt.call(buffered)
            print(f"slow {mode} stream: {slow_tokens} tokens generated, {held} held by the router's session, "
                  f"{got[0]} bytes read")
            assert 0 < held <= 2 * limit, f"the router holds {held} tokens"

            # The others are unaffected: exact and prompt, while the slow one stays paused.
            tok = Tokenizer(path)
            prompts = [[20 + i, 21 + i, 22 + i] for i in range(4)]
            results: list[tuple[str, float]] = [("", 0.0)] * 4

            def one(i: int) -> None:
                t0 = time.monotonic()
                text = ""
                with httpx.stream("POST", rt.url + "/v1/completions", timeout=60,
                                  json={"model": path.name, "prompt": prompts[i], "max_tokens": 24,
                                        "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text += json.loads(line[6:])["choices"][0]["text"]
                results[i] = (text, time.monotonic() - t0)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            for i, (text, took) in enumerate(results):
                assert text == tok.decode(hf_greedy(path, prompts[i], 24)), f"stream {i} differs"
                assert took < 20, f"stream {i} took {took:.1f}s beside the slow reader"
            assert _load(stub).paused == 1
            assert rt.call(buffered) <= 2 * limit

            stop.set()  # the slow client goes away: its request is aborted and everything is freed
            reader.join(10)
            deadline = time.monotonic() + 20
            while (ld := _load(stub)).used_blocks or ld.paused or ld.running:
                assert time.monotonic() < deadline, f"the slow request was not freed: {ld}"
                time.sleep(0.1)
    finally:
        stop.set()
        if reader is not None:
            reader.join(10)
        rt.stop()
        w.stop()
        if pre is not None:
            pre.stop()


def test_a_stream_paused_past_the_stall_timeout_fails_with_a_clear_error_not_retried(
        checkpoint: Callable[[str], Path]) -> None:
    """The router's session pauses a request whose consumer takes nothing (16 tokens buffered); the worker, with
    ``--stream-stall-timeout 1``, fails it a second later. The consumer, when it comes back, gets what was
    buffered and then FAILED_PRECONDITION naming the stall (the client's doing: the dispatcher does not retry
    it), and the worker has freed every block."""
    from router.session import SessionError, WorkerSession

    w = start_worker("decode", str(checkpoint("llama")), "tcp", ["--num-kv-blocks", "128", "--threads", "1",
                                                                 "--stream-stall-timeout", "1"])
    try:
        async def run() -> tuple[int, SessionError | None, pb.LoadResponse]:
            async with grpc.aio.insecure_channel(w.address) as ch:
                stub = pb_grpc.WorkerStub(ch)
                session = WorkerSession(stub, w.address)
                req = pb.GenerateRequest(request_id="stall", prompt_token_ids=[5, 6, 7],
                                         params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                  ignore_eos=True))
                gen = session.generate(req, 60.0, max_buffered_tokens=16)
                got = len((await gen.__anext__()).token_ids)
                # takes nothing: paused, then failed by the worker (nothing running or paused there any more)
                deadline = time.monotonic() + 20
                while (ld := await stub.Load(pb.LoadRequest(), timeout=10)).running or ld.paused or ld.waiting:
                    assert time.monotonic() < deadline, f"the stalled request was never failed: {ld}"
                    await asyncio.sleep(0.1)
                err = None
                try:
                    async for chunk in gen:
                        got += len(chunk.token_ids)
                except SessionError as e:
                    err = e
                deadline = time.monotonic() + 10
                while (ld := await stub.Load(pb.LoadRequest(), timeout=10)).used_blocks:
                    assert time.monotonic() < deadline, ld
                    await asyncio.sleep(0.1)
                await session.close()
                return got, err, ld

        got, err, ld = asyncio.run(run())
        assert err is not None and err.code == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "stalled" in err.details, err.details
        assert got < 200, f"{got} tokens generated for a consumer that took one chunk"
        assert ld.paused == 0 and ld.running == 0 and ld.used_blocks == 0
    finally:
        w.stop()
