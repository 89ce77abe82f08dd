"""A disaggregated request's ``Decode`` over the router's batched ``Session`` stream (``SessionRequest.decode``).

Real ``tandem worker`` processes (one prefill, one decode, the tcp KV backend); the router's end is
``router.session.WorkerSession`` on the test's own event loop, over the worker's plain-TCP session port (what a
router uses) or its gRPC ``Session`` call. Each request is reserved and prefilled over gRPC as the dispatcher does
(router/dispatch.py), then decoded over the session, and compared with the ``Decode`` call's output: the same
tokens (and transformers' greedy ones), the same refusal status, an abort and one request's failure touching no
other request on the session, and every block freed on both workers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.session import SessionError, WorkerSession, host_of
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "256", "--threads", "1"]
MAX_NEW = 12


def _params(max_tokens: int = MAX_NEW) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2000) for _ in range(rng.randrange(20, 90))] for _ in range(n)]


class Pair:
    def __init__(self, model: Path) -> None:
        self.model = model
        self.prefill = start_worker("prefill", str(model), "tcp", FLAGS)
        try:
            self.decode = start_worker("decode", str(model), "tcp", FLAGS)
        except BaseException:
            self.prefill.stop()
            raise

    def stop(self) -> None:
        for w in (self.prefill, self.decode):
            w.stop()


@pytest.fixture(scope="module")
def pair(checkpoint: Callable[[str], Path]) -> Iterator[Pair]:
    p = Pair(checkpoint("llama"))
    yield p
    p.stop()


class Client:
    """Stubs to both workers and the router's session to the decode worker, on the running loop."""

    def __init__(self, pair: Pair, tcp: bool) -> None:
        self.pair = pair
        self.tcp = tcp

    async def __aenter__(self) -> Client:
        self.pch = grpc.aio.insecure_channel(self.pair.prefill.address)
        self.dch = grpc.aio.insecure_channel(self.pair.decode.address)
        self.pstub = pb_grpc.WorkerStub(self.pch)
        self.dstub = pb_grpc.WorkerStub(self.dch)
        self.session = WorkerSession(self.dstub, self.pair.decode.address)
        if self.tcp:
            port = (await self.dstub.Health(pb.HealthRequest(), timeout=10)).session_port
            assert port, "the decode worker serves no session port"
            self.session.use_tcp(host_of(self.pair.decode.address), port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.pch.close()
        await self.dch.close()

    async def handoff(self, rid: str, prompt: list[int], params: pb.SamplingParams,
                      min_chunk_tokens: int = 0) -> tuple[pb.PrefillResponse, pb.DecodeRequest]:
        """Reserve on decode, prefill into it: the DecodeRequest the dispatcher would send next."""
        r = await self.dstub.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                                       lease_ms=20_000), timeout=60)
        first = await self.pstub.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                                           destination=r.destination, lease_ms=20_000), timeout=60)
        return first, pb.DecodeRequest(request_id=rid, first_token_id=first.first_token_id,
                                       min_chunk_tokens=min_chunk_tokens, first_token_sent=True)

    async def over_session(self, rid: str, prompt: list[int], params: pb.SamplingParams,
                           min_chunk_tokens: int = 0) -> tuple[list[int], list[pb.TokenChunk]]:
        first, dreq = await self.handoff(rid, prompt, params, min_chunk_tokens)
        chunks = [c async for c in self.session.decode(dreq, 60.0)]
        return [first.first_token_id] + [t for c in chunks for t in c.token_ids], chunks

    async def over_call(self, rid: str, prompt: list[int], params: pb.SamplingParams,
                        min_chunk_tokens: int = 0) -> tuple[list[int], list[pb.TokenChunk]]:
        first, dreq = await self.handoff(rid, prompt, params, min_chunk_tokens)
        chunks = [c async for c in self.dstub.Decode(dreq, timeout=60)]
        return [first.first_token_id] + [t for c in chunks for t in c.token_ids], chunks

    async def wait_all_free(self, timeout_s: float = 20.0) -> list[pb.LoadResponse]:
        """Poll both workers until no block is used or held and nothing runs, waits or transfers."""
        deadline = time.monotonic() + timeout_s
        while True:
            loads = [await s.Load(pb.LoadRequest(), timeout=10) for s in (self.pstub, self.dstub)]
            if all(ld.used_blocks == 0 and ld.held_blocks == 0 and ld.running == 0 and ld.waiting == 0
                   and ld.waiting_for_kv == 0 and ld.transfers_in_flight == 0 and ld.paused == 0 for ld in loads):
                return loads
            assert time.monotonic() < deadline, f"blocks or requests left: {loads}"
            await asyncio.sleep(0.05)


def _run(pair: Pair, tcp: bool, body: Callable[[Client], Any]) -> Any:
    async def main() -> Any:
        async with Client(pair, tcp) as c:
            out = await body(c)
            loads = await c.wait_all_free()
            for ld in loads:
                assert ld.free_blocks == ld.total_blocks == 256, ld
            return out

    return asyncio.run(main())


@pytest.mark.parametrize("tcp", [True, False], ids=["tcp-port", "grpc-session"])
def test_decode_over_the_session_is_token_exact_with_the_decode_call_and_transformers(
        pair: Pair, tcp: bool, hf_greedy: Callable[..., list[int]]) -> None:
    """Eight requests decoded at once over one session, half of them paced (min_chunk_tokens 4), give exactly the
    tokens the ``Decode`` call gives for the same prompts, and transformers' greedy tokens; the session's chunks
    leave the first token out (the caller has it from Prefill) and hold tokens as the call's do."""
    prompts = _prompts(8, seed=3)

    async def body(c: Client) -> tuple[list[Any], list[Any]]:
        sess = await asyncio.gather(*(c.over_session(f"s{tcp}-{i}", p, _params(), 4 if i % 2 else 0)
                                      for i, p in enumerate(prompts)))
        calls = await asyncio.gather(*(c.over_call(f"c{tcp}-{i}", p, _params(), 4 if i % 2 else 0)
                                       for i, p in enumerate(prompts)))
        return sess, calls

    sess, calls = _run(pair, tcp, body)
    for i, ((s_tokens, s_chunks), (c_tokens, c_chunks)) in enumerate(zip(sess, calls, strict=True)):
        assert s_tokens == c_tokens, i
        assert len(s_tokens) == MAX_NEW
        assert s_chunks[-1].finish_reason == c_chunks[-1].finish_reason == "length"
        assert all(c.token_ids for c in s_chunks[:-1]), "an empty chunk other than the last"
        if i % 2:  # paced: every chunk but the last holds at least 4 tokens, the skipped first one not counted
            assert all(len(c.token_ids) >= 4 for c in s_chunks[:-1]), [len(c.token_ids) for c in s_chunks]
        assert "".join(c.text for c in s_chunks) == "".join(c.text for c in c_chunks), i
    for p, (tokens, _) in list(zip(prompts, sess, strict=True))[:3]:
        assert tokens == hf_greedy(pair.model, p, MAX_NEW)


def test_a_refused_decode_gets_the_decode_calls_status_and_touches_no_other_request(pair: Pair) -> None:
    """A Decode of a request this worker never reserved fails on the session with NOT_FOUND, the status and
    message the ``Decode`` call gives; requests beside it on the same session, before and after, finish exactly."""
    prompts = _prompts(3, seed=5)

    async def body(c: Client) -> tuple[SessionError | None, grpc.aio.AioRpcError | None, list[Any], list[Any]]:
        good = [asyncio.ensure_future(c.over_session(f"ok-{i}", p, _params())) for i, p in enumerate(prompts[:2])]
        bad = pb.DecodeRequest(request_id="never-reserved", first_token_id=7, first_token_sent=True)
        s_err = None
        try:
            async for _ in c.session.decode(bad, 30.0):
                pass
        except SessionError as e:
            s_err = e
        g_err = None
        try:
            async for _ in c.dstub.Decode(bad, timeout=30):
                pass
        except grpc.aio.AioRpcError as e:
            g_err = e
        after = await c.over_session("ok-after", prompts[2], _params())
        ref = [await c.over_call(f"ref-{i}", p, _params()) for i, p in enumerate(prompts)]
        return s_err, g_err, [*(await asyncio.gather(*good)), after], ref

    s_err, g_err, good, ref = _run(pair, True, body)
    assert s_err is not None and g_err is not None
    assert s_err.code == g_err.code() == grpc.StatusCode.NOT_FOUND
    assert s_err.details == g_err.details(), (s_err.details, g_err.details())
    assert [t for t, _ in good] == [t for t, _ in ref]


def test_an_aborted_decode_frees_its_blocks_and_the_other_requests_finish_exactly(pair: Pair) -> None:
    """A long decode given up after its first chunk (its consumer closes the generator, as a client going away
    does) is aborted over the session: both workers free every block, and two requests decoding beside it on the
    same session give the ``Decode`` call's tokens. A decode paused by backpressure (16 tokens buffered) resumes
    once read and finishes exactly too."""
    prompts = _prompts(4, seed=9)

    async def body(c: Client) -> tuple[list[Any], list[Any], list[int], list[int]]:
        others = [asyncio.ensure_future(c.over_session(f"beside-{i}", p, _params(40)))
                  for i, p in enumerate(prompts[:2])]
        _, dreq = await c.handoff("long", prompts[2], _params(3000))
        gen = c.session.decode(dreq, 60.0)
        assert (await gen.__anext__()).token_ids
        await gen.aclose()
        # paced: its consumer sleeps with 16 tokens buffered, the worker pauses it, then it is read to the end
        first, dreq = await c.handoff("slow", prompts[3], _params(200))
        slow = [first.first_token_id]
        gen = c.session.decode(dreq, 60.0, max_buffered_tokens=16)
        slow.extend((await gen.__anext__()).token_ids)
        await asyncio.sleep(1.0)
        paused = (await c.dstub.Load(pb.LoadRequest(), timeout=10)).paused
        slow.extend([t async for chunk in gen for t in chunk.token_ids])
        ref = [await c.over_call(f"ref-{i}", p, _params(40)) for i, p in enumerate(prompts[:2])]
        slow_ref, _ = await c.over_call("slow-ref", prompts[3], _params(200))
        assert paused == 1, "the unread decode was not paused on the worker"
        return list(await asyncio.gather(*others)), ref, slow, slow_ref

    beside, ref, slow, slow_ref = _run(pair, True, body)
    assert [t for t, _ in beside] == [t for t, _ in ref]
    assert slow == slow_ref and len(slow) == 200


def test_a_decode_worker_killed_mid_stream_migrates_a_disaggregated_request_exactly(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """Through the router (router/dispatch.py): a long prompt is prefilled on the prefill worker and decoded over
    the decode worker's session; that worker is SIGKILLed mid-stream. The session breaks, the request migrates to
    the other decode worker (again disaggregated, its Decode on that worker's session), and the client gets
    exactly transformers' greedy tokens; the surviving workers free every block."""
    import httpx
    from gateway_harness import RouterThread, routed_worker

    from engine.tokenizer import Tokenizer
    from router.server import RouterConfig

    path = checkpoint("llama")
    pre = start_worker("prefill", str(path), "tcp", [*FLAGS, "--worker-id", "sd-pre"])
    decs = [start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", f"sd-dec-{i}"]) for i in range(2)]
    rt = RouterThread(RouterConfig(model=str(path), workers=(pre.address, *(w.address for w in decs))))
    try:
        prompt = [random.Random(17).randrange(2000) for _ in range(120)]
        max_tokens = 300
        text, chunks, finish = "", 0, None
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=120, headers={"x-tandem-explain": "1"},
                          json={"model": path.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            route = r.headers["x-tandem-route"]
            assert "prefill[" in route, route  # disaggregated
            victim = next(w for w in decs if f"sd-dec-{decs.index(w)}" == routed_worker(route))
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                chunks += 1
                if chunks == 5:
                    victim.kill()
        assert text == Tokenizer(path).decode(hf_greedy(path, prompt, max_tokens))
        assert finish == "length"
        survivor = next(w for w in decs if w is not victim)

        def seen(r: Any) -> tuple[int, int]:
            session = r.pool.workers[survivor.address].session
            return r.dispatcher.stats.migrations, session.opened if session is not None else 0

        stats = rt.call(seen)
        assert stats[0] == 1 and stats[1] >= 1, stats  # migrated once; the survivor's Decode rode its session

        async def loads() -> list[pb.LoadResponse]:
            out = []
            for w in (pre, survivor):
                async with grpc.aio.insecure_channel(w.address) as ch:
                    stub = pb_grpc.WorkerStub(ch)
                    deadline = time.monotonic() + 20
                    while (ld := await stub.Load(pb.LoadRequest(), timeout=10)).used_blocks or ld.held_blocks \
                            or ld.running or ld.transfers_in_flight:
                        assert time.monotonic() < deadline, ld
                        await asyncio.sleep(0.05)
                    out.append(ld)
            return out

        assert all(ld.free_blocks == ld.total_blocks for ld in asyncio.run(loads()))
    finally:
        rt.stop()
        for w in (pre, *decs):
            w.stop()
