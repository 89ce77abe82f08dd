"""A slow worker is busy, not gone: the router keeps offering it requests while its probes time out.

On a loaded host (the CI machine runs everything on 2 cores) a worker may answer a ``Health`` or ``Load`` probe
later than the probe's deadline. The router used to mark it down on the first such timeout, so every request that
arrived before its next answered probe got ``503 no decode worker is available`` although the worker was alive and
would have served it. Now only a probe the worker refuses (its port closed: the process is gone) or a ``Health``
that says so takes it away at once; a worker that merely answers late stays available until it has been silent
for ``worker_dead_after_s``, when it is cut off (tests/test_routing.py covers the cut-off).

The end-to-end case freezes a real worker process (SIGSTOP) for longer than both probes' deadlines, well within
``worker_dead_after_s``: the router keeps it available all along, and a request sent meanwhile is answered, the
same as before the pause, once the worker runs again. The unit cases drive the dispatcher's failure path with the
worker's stub replaced by an in-process object (as tests/test_router_pool.py does), because which probe answers
when is what they are about: one request's failure on a worker that still answers its probes does not take the
worker from the others, and one whose port is closed is taken away at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread

from proto.tandem.v1 import worker_pb2 as pb
from router.cost import CostConfig
from router.dispatch import Dispatcher, DispatchError
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.pool import Worker, WorkerPool
from router.selector import Selector
from router.server import RouterConfig
from router.session import SessionError
from worker.launcher import start_worker

PAUSE_S = 5.0  # longer than a Load probe's deadline plus a Health probe's (2 s each), shorter than dead-after (10 s)


@pytest.mark.slow
def test_a_worker_frozen_past_its_probe_deadlines_stays_available_and_serves(
        checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    worker = start_worker("decode", str(path), "tcp", [*WORKER_FLAGS, "--worker-id", "frozen"])
    rt = RouterThread(RouterConfig(model=str(path), workers=(worker.address,), worker_dead_after_s=10.0))
    body = {"model": path.name, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    stopped = False
    try:
        before = httpx.post(rt.url + "/v1/completions", json=body, timeout=60)
        assert before.status_code == 200, before.text
        os.kill(worker.proc.pid, signal.SIGSTOP)
        stopped = True
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answers.append(
            httpx.post(rt.url + "/v1/completions", json=body, timeout=60)))
        sender.start()
        unavailable_at: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < PAUSE_S:
            if not rt.call(lambda r: r.pool.available("decode")):
                unavailable_at.append(time.monotonic() - t0)
            time.sleep(0.05)
        os.kill(worker.proc.pid, signal.SIGCONT)
        stopped = False
        assert not unavailable_at, f"the frozen worker was taken away {unavailable_at[0]:.1f} s into the pause"
        sender.join(60)
        assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
        assert answers[0].json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert not rt.call(lambda r: r.pool.workers[worker.address].cut_off)
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signal.SIGCONT)
        rt.stop()
        worker.stop()


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), code.name)


class _Stub:
    """A worker's ``Health``: answered SERVING, or failed with ``fails`` (a status code) when that is set."""

    def __init__(self) -> None:
        self.fails: grpc.StatusCode | None = None
        self.asked = 0

    async def Health(self, request: pb.HealthRequest, timeout: float) -> pb.HealthResponse:
        self.asked += 1
        await asyncio.sleep(0.01)
        if self.fails is not None:
            raise _error(self.fails)
        return pb.HealthResponse(status="SERVING", role="decode", worker_id="d0")


def _dispatcher(stub: _Stub) -> tuple[Dispatcher, Worker]:
    pool = WorkerPool([])
    w = Worker("127.0.0.1:1", role="decode", worker_id="d0", healthy=True, last_seen=time.monotonic())
    w.stub = stub  # type: ignore[assignment]
    pool.workers[w.address] = w
    sel = Selector(KVIndex(1000), LoadTracker(), CostConfig(block_size=16), 16)
    return Dispatcher(pool, sel, sel), w


async def _settle(stub: _Stub) -> None:
    """Until the worker has been probed (2 s at most), and a little longer for the answer to be applied."""
    deadline = asyncio.get_running_loop().time() + 2
    while stub.asked == 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_one_requests_failure_on_a_worker_that_answers_leaves_it_to_the_others(code: grpc.StatusCode) -> None:
    async def scenario() -> None:
        stub = _Stub()
        d, w = _dispatcher(stub)
        exclude: set[str] = set()
        plan = d.plan([1, 2, 3], exclude)
        attempt = await d._after_failure(SessionError(code, "one request failed"), plan, "r0", 0, exclude, [])
        assert attempt == 1 and exclude == {w.address}  # that request goes elsewhere ...
        await _settle(stub)
        assert d.pool.available("decode") == [w]  # ... while every other request still has the worker
        assert d.plan([4, 5, 6], set()).decode is w
        await d.pool.close()

    asyncio.run(scenario())


def test_a_worker_whose_port_is_closed_is_taken_away_after_a_failure() -> None:
    async def scenario() -> None:
        stub = _Stub()
        stub.fails = grpc.StatusCode.UNAVAILABLE
        d, w = _dispatcher(stub)
        exclude: set[str] = set()
        plan = d.plan([1, 2, 3], exclude)
        await d._after_failure(SessionError(grpc.StatusCode.UNAVAILABLE, "session broke"), plan, "r0", 0,
                               exclude, [])
        await _settle(stub)
        assert not w.healthy and d.pool.available("decode") == []
        with pytest.raises(DispatchError, match="no decode worker is available"):
            d.plan([4, 5, 6], set())
        await d.pool.close()

    asyncio.run(scenario())


def test_a_health_probe_that_times_out_does_not_take_an_answering_worker_away() -> None:
    async def scenario() -> None:
        stub = _Stub()
        stub.fails = grpc.StatusCode.DEADLINE_EXCEEDED
        pool = WorkerPool([])
        w = Worker("127.0.0.1:1", role="decode", worker_id="d0", healthy=True, last_seen=time.monotonic())
        w.stub = stub  # type: ignore[assignment]
        pool.workers[w.address] = w
        assert not await pool._health(w)  # no answer in time ...
        pool._unanswered(w, time.monotonic())
        assert pool.available("decode") == [w]  # ... but late is not gone,
        assert w.answering  # nor dropped from a Redis registry whose lease for it lapsed (router/redis_bus.py)
        stub.fails = grpc.StatusCode.UNAVAILABLE
        assert not await pool._health(w)
        assert pool.available("decode") == [] and not w.answering  # refused: gone

    asyncio.run(scenario())
