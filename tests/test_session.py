"""The multiplexed ``Session`` stream between the router and a worker (router/session.py, worker/session.py).

Real ``tandem worker`` processes on loopback, driven by the router's real ``WorkerSession`` over ``grpc.aio``: many
requests share one stream, yet each gets exactly what its own ``Generate`` call would (and transformers' greedy
tokens); a request given up, a session closed with requests running and a worker killed mid-stream each end
every request explicitly and leave every KV block free. The restart test uses the bench's fake worker (no engine)
because only the stream matters there.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.session import SessionError, WorkerSession
from wire.framing import KEEPALIVE_IDLE_S, MAX_FRAME, USER_TIMEOUT_S, frame, read_frames
from worker.launcher import WorkerProcess, start_worker

FLAGS = ["--num-kv-blocks", "128", "--threads", "1"]


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path]) -> Iterator[WorkerProcess]:
    w = start_worker("both", str(checkpoint("llama")), "tcp", FLAGS)
    yield w
    w.stop()


async def _session_port(ch: grpc.aio.Channel) -> int:
    """The worker's plain-TCP session port, from its health answer (waiting for a worker that is starting)."""
    health = await pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10, wait_for_ready=True)
    assert health.session_port, "the worker names no TCP session port"
    return int(health.session_port)


async def _open(ch: grpc.aio.Channel, address: str, transport: str) -> WorkerSession:
    """A router-side session to ``address``: on the gRPC Session, or on the worker's plain-TCP transport."""
    session = WorkerSession(pb_grpc.WorkerStub(ch), address)
    if transport == "tcp":
        session.use_tcp("127.0.0.1", await _session_port(ch))
    return session


TRANSPORTS = pytest.mark.parametrize("transport", ["grpc", "tcp"])


def _greedy(rid: str, prompt: list[int], max_tokens: int, min_chunk_tokens: int = 0,
            **kw: object) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                              min_chunk_tokens=min_chunk_tokens)


async def _collect(session: WorkerSession, req: pb.GenerateRequest) -> list[pb.TokenChunk]:
    return [c async for c in session.generate(req, timeout_s=60.0)]


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass


def _wait_idle(address: str, timeout_s: float = 15.0) -> pb.LoadResponse:
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        deadline = time.monotonic() + timeout_s
        while True:
            ld = stub.Load(pb.LoadRequest(), timeout=5)
            if (ld.used_blocks == 0 and ld.running == 0 and ld.waiting == 0) or time.monotonic() > deadline:
                return ld
            time.sleep(0.05)


def _assert_all_free(address: str) -> None:
    ld = _wait_idle(address)
    assert ld.used_blocks == 0 and ld.running == 0 and ld.waiting == 0, f"requests or blocks left over: {ld}"
    assert ld.free_blocks == ld.total_blocks == 128, f"leaked blocks: {ld}"


def _generate_call(address: str, req: pb.GenerateRequest) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        return [t for c in pb_grpc.WorkerStub(ch).Generate(req, timeout=60) for t in c.token_ids]


@TRANSPORTS
def test_requests_on_one_session_equal_their_own_generate_calls_and_transformers(
        worker: WorkerProcess, checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]],
        transport: str) -> None:
    """Ten prompts of mixed lengths written at once (one batched message), streamed and paced."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2000) for _ in range(rng.randrange(1, 70))] for _ in range(10)]

    async def run() -> list[list[pb.TokenChunk]]:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            session = await _open(ch, worker.address, transport)
            reqs = [_greedy(f"s{i}", p, 12, min_chunk_tokens=0 if i % 2 else 5) for i, p in enumerate(prompts)]
            out = await asyncio.gather(*(_collect(session, r) for r in reqs))
            assert session.opened == 1 and session.in_flight == 0
            await session.close()
            return out

    results = asyncio.run(run())
    path = checkpoint("llama")
    for i, (prompt, chunks) in enumerate(zip(prompts, results, strict=True)):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == hf_greedy(path, prompt, 12), f"prompt {i} diverged from transformers"
        assert tokens == _generate_call(worker.address, _greedy(f"g{i}", prompt, 12))
        assert chunks[-1].finish_reason == "length" and all(not c.finish_reason for c in chunks[:-1])
        assert chunks[-1].num_prompt_tokens == len(prompt)
        if i % 2 == 0:  # paced: every chunk but the last holds at least 5 tokens
            assert all(len(c.token_ids) >= 5 for c in chunks[:-1])
    _assert_all_free(worker.address)


@TRANSPORTS
def test_bad_requests_fail_alone_with_their_status(worker: WorkerProcess, transport: str) -> None:
    good = [3, 4, 5, 6]

    async def run() -> tuple[list[list[pb.TokenChunk] | BaseException], list[pb.TokenChunk]]:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            session = await _open(ch, worker.address, transport)
            bad = [_greedy("bad-temp", good, 4, top_p=1.5),
                   _greedy("bad-token", [3, 10**6], 4),
                   _greedy("too-long", [5] * 5000, 4)]
            errs = await asyncio.gather(*(_collect(session, r) for r in bad), return_exceptions=True)
            ok = await _collect(session, _greedy("fine", good, 4))
            await session.close()
            return errs, ok

    errs, ok = asyncio.run(run())
    for e in errs:
        assert isinstance(e, SessionError) and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
    assert "top_p" in str(errs[0]) and "out of range" in str(errs[1])
    assert sum(len(c.token_ids) for c in ok) == 4 and ok[-1].finish_reason == "length"
    _assert_all_free(worker.address)


@TRANSPORTS
def test_given_up_requests_and_a_closed_session_free_every_block(worker: WorkerProcess, transport: str) -> None:
    """Two requests are given up after their first chunk (aborted through the session), two are still running
    when the session closes (the worker aborts them): nothing is left on the worker."""
    async def run() -> None:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            session = await _open(ch, worker.address, transport)
            gens = [session.generate(_greedy(f"long{i}", [7 + i] * 40, 400), timeout_s=60.0) for i in range(4)]
            for g in gens:
                first = await g.__anext__()
                assert first.token_ids and not first.finish_reason
            for g in gens[:2]:
                await g.aclose()
            ld = pb_grpc.WorkerStub(ch).Load(pb.LoadRequest())
            assert (await ld).used_blocks > 0
            await session.close()
            for g in gens[2:]:
                with pytest.raises(SessionError) as e:
                    async for _ in g:
                        pass
                assert e.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
    _assert_all_free(worker.address)


def test_a_bad_frame_on_the_tcp_session_port_ends_that_session_and_frees_its_blocks(worker: WorkerProcess) -> None:
    """A raw connection to the worker's TCP session port starts a long request, then sends a frame header that
    claims more than ``MAX_FRAME`` bytes: the worker drops that connection (its reply stream ends), aborts the
    request, frees its blocks, and goes on serving other sessions."""
    async def port() -> int:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            return await _session_port(ch)

    session_port = asyncio.run(port())
    with socket.create_connection(("127.0.0.1", session_port), timeout=30) as conn:
        msg = pb.SessionRequest(generate=[_greedy("raw", [5] * 40, 400)])
        conn.sendall(frame(msg.SerializeToString()))
        replies = read_frames(conn)
        first = pb.SessionReply.FromString(next(replies))
        assert first.chunks[0].request_id == "raw" and not first.chunks[0].chunk.finish_reason
        conn.sendall(struct.pack(">I", MAX_FRAME + 1))
        deadline = time.monotonic() + 30
        with contextlib.suppress(ConnectionResetError):  # a reset is a close too
            for _ in replies:  # whatever was already on its way, then the worker closes the connection
                assert time.monotonic() < deadline, "the worker kept the connection after a bad frame"
    _assert_all_free(worker.address)
    req = _greedy("after", [1, 2, 3], 4)
    assert len(_generate_call(worker.address, req)) == 4


@TRANSPORTS
def test_collect_hands_every_chunk_to_its_sink_and_a_done_sink_aborts_the_rest(
        worker: WorkerProcess, checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]],
        transport: str) -> None:
    """``collect`` (the path of answers sent whole): the sink sees exactly the tokens ``generate`` yields, in
    chunks paced as asked; a sink that returns True after its first chunk ends the request there and the rest is
    aborted on the worker; a bad request raises its status; a sink that raises fails only its own request."""
    rng = random.Random(11)
    prompts = [[rng.randrange(2000) for _ in range(rng.randrange(1, 50))] for _ in range(6)]

    async def run() -> tuple[list[list[pb.TokenChunk]], list[pb.TokenChunk], BaseException, BaseException, int]:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            session = await _open(ch, worker.address, transport)
            outs: list[list[pb.TokenChunk]] = [[] for _ in prompts]

            def sink_for(i: int) -> Callable[[pb.TokenChunk], bool]:
                def sink(c: pb.TokenChunk) -> bool:
                    outs[i].append(c)
                    return False
                return sink

            await asyncio.gather(*(session.collect(_greedy(f"c{i}", p, 10, min_chunk_tokens=4), 60.0, sink_for(i))
                                   for i, p in enumerate(prompts)))
            early: list[pb.TokenChunk] = []

            def stop_at_first(c: pb.TokenChunk) -> bool:
                early.append(c)
                return True

            await session.collect(_greedy("early", [9] * 30, 400), 60.0, stop_at_first)
            with pytest.raises(SessionError) as bad:
                await session.collect(_greedy("bad", [3, 10**6], 4), 60.0, stop_at_first)

            def broken(c: pb.TokenChunk) -> bool:
                raise RuntimeError("consumer bug")

            with pytest.raises(RuntimeError) as raised:
                await session.collect(_greedy("broken", [4] * 20, 300), 60.0, broken)
            after: list[pb.TokenChunk] = []

            def keep(c: pb.TokenChunk) -> bool:
                after.append(c)
                return False

            await session.collect(_greedy("after", [5, 6], 3), 60.0, keep)
            in_flight = session.in_flight
            await session.close()
            return outs, early + after, bad.value, raised.value, in_flight

    outs, early_after, bad, raised, in_flight = asyncio.run(run())
    path = checkpoint("llama")
    for i, (prompt, chunks) in enumerate(zip(prompts, outs, strict=True)):
        assert [t for c in chunks for t in c.token_ids] == hf_greedy(path, prompt, 10), f"prompt {i}"
        assert chunks[-1].finish_reason == "length" and all(len(c.token_ids) >= 4 for c in chunks[:-1])
    early, after = early_after[0], early_after[1:]
    assert early.token_ids and not early.finish_reason  # stopped after one chunk of a 400-token request
    assert sum(len(c.token_ids) for c in after) == 3 and after[-1].finish_reason == "length"
    assert isinstance(bad, SessionError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(raised) == "consumer bug" and in_flight == 0
    _assert_all_free(worker.address)


def test_prefill_worker_refuses_colocated_requests(checkpoint: Callable[[str], Path]) -> None:
    prefill = start_worker("prefill", str(checkpoint("llama")), "tcp", FLAGS)
    try:
        async def run() -> None:
            async with grpc.aio.insecure_channel(prefill.address) as ch:
                session = WorkerSession(pb_grpc.WorkerStub(ch), prefill.address)
                with pytest.raises(SessionError) as e:
                    await _collect(session, _greedy("p", [1, 2, 3], 4))
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "prefill" in e.value.details
                await session.close()

        asyncio.run(run())
    finally:
        prefill.stop()


@TRANSPORTS
def test_worker_killed_mid_stream_fails_every_request_on_the_session_at_once(
        checkpoint: Callable[[str], Path], transport: str) -> None:
    victim = start_worker("both", str(checkpoint("llama")), "tcp", FLAGS)
    try:
        async def run() -> float:
            async with grpc.aio.insecure_channel(victim.address) as ch:
                session = await _open(ch, victim.address, transport)
                gens = [session.generate(_greedy(f"k{i}", [9 + i] * 20, 2000), timeout_s=60.0) for i in range(3)]
                for g in gens:
                    await g.__anext__()
                victim.kill()
                t0 = time.monotonic()
                for g in gens:
                    with pytest.raises(SessionError) as e:
                        async for _ in g:
                            pass
                    assert e.value.code == grpc.StatusCode.UNAVAILABLE
                assert session.in_flight == 0
                await session.close()
                return time.monotonic() - t0

        assert asyncio.run(run()) < 5.0
    finally:
        victim.stop()


def _fake(port: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.fake_worker", "--port", str(port), "--tokens", "3"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    return proc, int(line.split()[1])


@TRANSPORTS
def test_a_broken_session_is_replaced_by_the_next_request(transport: str) -> None:
    proc, port = _fake(0)
    try:
        async def run() -> None:
            nonlocal proc
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as ch:
                session = await _open(ch, address, transport)
                assert len([c async for c in session.generate(_greedy("a", [1], 3), 10.0)]) == 3
                proc.kill()
                proc.wait(5)
                with pytest.raises(SessionError) as e:
                    await _collect(session, _greedy("b", [1], 3))
                assert e.value.code == grpc.StatusCode.UNAVAILABLE
                proc, _ = _fake(port)
                if transport == "tcp":  # a restarted worker listens on a new session port: its health names it
                    session.use_tcp("127.0.0.1", await _session_port(ch))
                deadline = time.monotonic() + 10
                while True:  # the channel reconnects with backoff; each failed try fails that request only
                    try:
                        chunks = await _collect(session, _greedy(f"c{session.opened}", [1], 3))
                        break
                    except SessionError:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.2)
                assert [t for c in chunks for t in c.token_ids] == [300, 301, 302]
                assert session.opened >= 2
                await session.close()

        asyncio.run(run())
    finally:
        proc.kill()
        proc.wait(5)


def test_an_unreachable_session_port_falls_back_to_grpc_without_failing_a_request() -> None:
    """A health answer names a TCP session port the router cannot reach (here: a port nothing listens on). The
    requests written meanwhile go on a gRPC Session stream instead, none fails, and later requests stay on gRPC
    even when the next health answer names that port again."""
    proc, port = _fake(0)
    try:
        async def run() -> None:
            address = f"127.0.0.1:{port}"
            with socket.socket() as s:  # a port that was free a moment ago: connecting is refused
                s.bind(("127.0.0.1", 0))
                closed = s.getsockname()[1]
            async with grpc.aio.insecure_channel(address) as ch:
                session = WorkerSession(pb_grpc.WorkerStub(ch), address)
                session.use_tcp("127.0.0.1", closed)
                chunks = await asyncio.gather(*(_collect(session, _greedy(f"r{i}", [1], 3)) for i in range(5)))
                assert all([t for c in cs for t in c.token_ids] == [300, 301, 302] for cs in chunks)
                assert session.tcp is None and session.unreachable == ("127.0.0.1", closed)
                assert session.opened == 2  # the TCP try, then one gRPC stream for all of them
                session.use_tcp("127.0.0.1", closed)  # the next health poll: not tried again for a while
                assert session.tcp is None
                assert len(await _collect(session, _greedy("after", [1], 3))) == 3
                assert session.opened == 2
                await session.close()

        asyncio.run(run())
    finally:
        proc.kill()
        proc.wait(5)


def test_requests_that_produce_nothing_for_the_timeout_fail_and_free_their_blocks(
        checkpoint: Callable[[str], Path]) -> None:
    """A worker (in this process, a real gRPC server) with a 1 s request timeout: one request is streaming when the
    engine loop stalls for 4 s, another is sent during the stall and never produces anything. Both end with
    DEADLINE_EXCEEDED before the stall is over, and once the loop runs again both are aborted: no block is left."""
    from concurrent import futures

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from worker.service import WorkerService

    engine = LLMEngine(EngineConfig(model=str(checkpoint("llama")), num_threads=1,
                                    cache=CacheConfig(num_blocks=64)))
    service = WorkerService(engine, request_timeout_s=1.0)
    service.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_WorkerServicer_to_server(service, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        async def run() -> float:
            async with grpc.aio.insecure_channel(address) as ch:
                session = WorkerSession(pb_grpc.WorkerStub(ch), address)
                streaming = session.generate(_greedy("streaming", [5] * 10, 500), timeout_s=60.0)
                await streaming.__anext__()
                service.loop.call(lambda eng: time.sleep(4.0))  # the engine loop stops stepping
                t0 = time.monotonic()
                silent = session.generate(_greedy("silent", [6] * 10, 8), timeout_s=60.0)
                ends = await asyncio.gather(*(_drain(gen) for gen in (streaming, silent)), return_exceptions=True)
                elapsed = time.monotonic() - t0
                for e in ends:
                    assert isinstance(e, SessionError), e
                    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED and "produced nothing" in e.details
                await session.close()
                return elapsed

        assert asyncio.run(run()) < 3.5  # 1 s of silence, checked every second: well before the stall ends
        deadline = time.monotonic() + 10
        while (engine.has_unfinished() or engine.pool.num_used_blocks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished() and engine.pool.num_used_blocks == 0
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        server.stop(0)
        service.stop()


@TRANSPORTS
def test_a_burst_is_split_into_bounded_messages(monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """Requests queued together go out in messages of at most MAX_BATCH_REQUESTS requests and MAX_BATCH_TOKENS
    prompt tokens (one request alone may exceed the token cap); every request is still answered once."""
    import router.session as rs

    monkeypatch.setattr(rs, "MAX_BATCH_REQUESTS", 4)
    monkeypatch.setattr(rs, "MAX_BATCH_TOKENS", 100)
    proc, port = _fake(0)
    try:
        async def run() -> list[pb.SessionRequest]:
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as ch:
                session = await _open(ch, address, transport)
                sent: list[pb.SessionRequest] = []
                take = session._next_message

                def spy() -> pb.SessionRequest:
                    msg = take()
                    sent.append(msg)
                    return msg

                monkeypatch.setattr(session, "_next_message", spy)
                sizes = [30] * 8 + [250] + [10] * 6
                reqs = [_greedy(f"b{i}", [1] * n, 3) for i, n in enumerate(sizes)]
                outs = await asyncio.gather(*(_collect(session, r) for r in reqs))
                assert all([t for c in o for t in c.token_ids] == [300, 301, 302] for o in outs)
                await session.close()
                return sent

        sent = asyncio.run(run())
        assert sorted(g.request_id for m in sent for g in m.generate) == sorted(f"b{i}" for i in range(15))
        for m in sent:
            assert 1 <= len(m.generate) <= 4
            assert len(m.generate) == 1 or sum(len(g.prompt_token_ids) for g in m.generate) <= 100
        assert any(len(m.generate[0].prompt_token_ids) == 250 for m in sent)
    finally:
        proc.kill()
        proc.wait(5)


def test_a_burst_larger_than_the_socket_buffers_is_flow_controlled_on_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """About 16 MB of prompts written at once on the TCP transport: the transport pauses the session's writes
    when its buffer fills and resumes them as the worker reads; nothing is dropped or reordered, and every
    request is answered once."""
    import router.session as rs

    pauses: list[int] = []
    pause = rs._TcpStream.pause_writing

    def counted(self: rs._TcpStream) -> None:
        pauses.append(1)
        pause(self)

    monkeypatch.setattr(rs._TcpStream, "pause_writing", counted)
    proc, port = _fake(0)
    try:
        async def run() -> None:
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as ch:
                session = await _open(ch, address, "tcp")
                reqs = [_greedy(f"big{i}", [100_000 + i] * 20_000, 3) for i in range(200)]
                outs = await asyncio.gather(*(_collect(session, r) for r in reqs))
                assert all([t for c in o for t in c.token_ids] == [300, 301, 302] for o in outs)
                assert session.opened == 1 and session.in_flight == 0
                sock = session._call._transport.get_extra_info("socket")
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == USER_TIMEOUT_S * 1000
                await session.close()

        asyncio.run(run())
        assert pauses, "the transport never paused: the burst did not exceed its buffer"
    finally:
        proc.kill()
        proc.wait(5)


def test_the_session_port_refuses_connections_beyond_its_cap() -> None:
    """Each TCP session holds threads on the worker, so the listener closes a connection beyond
    ``max_connections`` at once; a slot freed by a closed session is taken again. The listener runs in process
    with a stand-in service (no request is sent, so no engine is needed)."""
    from types import SimpleNamespace

    from worker.session import SessionListener

    listener = SessionListener(SimpleNamespace(request_timeout_s=60.0), "127.0.0.1", 0,  # type: ignore[arg-type]
                               max_connections=2)
    conns: list[socket.socket] = []
    try:
        def connect() -> socket.socket:
            c = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
            conns.append(c)
            return c

        def closed_by_listener(c: socket.socket, wait_s: float) -> bool:
            c.settimeout(wait_s)
            try:
                return c.recv(1) == b""
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        first, second = connect(), connect()
        third = connect()
        assert closed_by_listener(third, 10.0)
        with listener._lock:
            accepted = list(listener._conns)
        assert len(accepted) == 2
        for c in accepted:  # a router that vanishes without closing is noticed by the kernel
            assert c.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert not closed_by_listener(first, 0.3) and not closed_by_listener(second, 0.3)
        first.close()
        deadline = time.monotonic() + 10
        while True:  # the first session ends (its reader sees EOF), then its slot is free
            fourth = connect()
            if not closed_by_listener(fourth, 0.5):
                break
            assert time.monotonic() < deadline, "a closed session's slot was never freed"
    finally:
        for c in conns:
            c.close()
        listener.close()
