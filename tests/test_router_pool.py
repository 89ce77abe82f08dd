"""The worker pool's liveness rule (router/pool.py), with the worker's stub replaced by an in-process object.

A fake stub stands in for a worker here because the rule is about which probes answer and when, which a real
worker cannot be made to choose (the end-to-end case, a SIGSTOPped worker whose streams fail over, is in
tests/test_routing.py). A worker that still answers ``Health`` while its ``Load`` times out is busy, not gone, and
keeps its requests; one that answers nothing for ``dead_after_s`` is cut off: its in-flight calls are cancelled
and it gets nothing new until it answers again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from proto.tandem.v1 import worker_pb2 as pb
from router.metrics import RouterMetrics
from router.pool import Worker, WorkerPool


def _timeout() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "Deadline Exceeded")


class _Stub:
    def __init__(self) -> None:
        self.load_answers = True
        self.health_answers = True

    async def Load(self, request: pb.LoadRequest, timeout: float) -> pb.LoadResponse:
        await asyncio.sleep(0.01)
        if not self.load_answers:
            raise _timeout()
        return pb.LoadResponse(total_blocks=8, free_blocks=8)

    async def Health(self, request: pb.HealthRequest, timeout: float) -> pb.HealthResponse:
        await asyncio.sleep(0.01)
        if not self.health_answers:
            raise _timeout()
        return pb.HealthResponse(status="SERVING", role="both", worker_id="w0")


class _Call:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _start(stub: _Stub) -> tuple[WorkerPool, Worker, _Call, asyncio.Task[None]]:
    """A pool polling one healthy worker (every 20 ms, cut off after 0.5 s of silence) with one call in flight."""
    pool = WorkerPool([], poll_interval_s=0.02, dead_after_s=0.5)
    w = Worker("127.0.0.1:1", role="both", worker_id="w0", healthy=True)
    w.stub = stub  # type: ignore[assignment]
    pool.workers[w.address] = w
    call = _Call()
    w.calls.add(call)
    return pool, w, call, asyncio.create_task(pool._poll(w))


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _stop(pool: WorkerPool, task: asyncio.Task[None]) -> None:
    pool._closing = True
    await task


def test_a_worker_that_answers_health_but_not_load_is_busy_not_cut_off() -> None:
    async def scenario() -> None:
        stub = _Stub()
        stub.load_answers = False
        pool, w, call, task = _start(stub)
        await asyncio.sleep(1.2)
        assert not w.cut_off and not call.cancelled  # Health's answers count: busy, not gone
        await _stop(pool, task)

    asyncio.run(scenario())


def test_a_silent_worker_is_cut_off_and_taken_back_once_it_answers() -> None:
    async def scenario() -> None:
        stub = _Stub()
        stub.load_answers = stub.health_answers = False
        pool, w, call, task = _start(stub)
        await asyncio.sleep(0.1)
        assert not w.cut_off and not call.cancelled  # silent, but not yet for dead_after_s
        await _until(lambda: w.cut_off)
        assert call.cancelled and not w.healthy and w.cutoffs == 1
        samples = {(x.name, x.labels.get("worker")): x.value
                   for fam in RouterMetrics(pool).registry.collect() for x in fam.samples}
        assert samples[("tandem_router_worker_cutoffs_total", "w0")] == 1
        assert samples[("tandem_worker_up", "w0")] == 0
        assert w not in pool.available("decode")
        stub.load_answers = stub.health_answers = True
        await _until(lambda: not w.cut_off and w.healthy)
        assert w.unanswered_since is None
        await _stop(pool, task)

    asyncio.run(scenario())


def test_a_worker_drained_elsewhere_is_seen_draining_within_a_second_and_stays_so() -> None:
    """Its controller's ``Drain`` reaches the worker, not the router: the pool's periodic Health finds the flag
    while Load keeps answering, stops offering the worker for either role, and never clears the flag again."""
    class _Draining(_Stub):
        draining = False

        async def Health(self, request: pb.HealthRequest, timeout: float) -> pb.HealthResponse:
            return pb.HealthResponse(status="SERVING", role="decode", worker_id="w0", draining=self.draining)

    async def scenario() -> None:
        stub = _Draining()
        pool, w, _, task = _start(stub)
        await _until(lambda: w.role == "decode")
        assert pool.available("decode") == [w]
        stub.draining = True
        await _until(lambda: w.draining, timeout_s=3.0)
        assert pool.available("decode") == [] and w.healthy  # kept for in-flight work, offered nothing new
        stub.draining = False  # a stale answer (sent before the Drain) cannot undo it
        await asyncio.sleep(1.5)
        assert w.draining
        await _stop(pool, task)

    asyncio.run(scenario())


def test_remove_waits_for_the_routers_own_requests_on_an_answering_worker_and_not_on_a_silent_one() -> None:
    """A drained worker reports nothing in flight once its last tokens are sent; they may still be on the way here.
    ``remove`` keeps the worker (its connections open) until this router's calls on it have ended, so that closing
    it fails no complete request; a worker that no longer answers is not waited for; and a request failing on a
    worker already removed does not probe its closed channel."""
    async def scenario() -> None:
        pool, w, call, task = _start(_Stub())
        await _until(lambda: w.last_seen > 0)
        removal = asyncio.create_task(pool.remove(w.address, grace_s=5.0))
        await asyncio.sleep(0.3)
        assert not removal.done() and pool.workers.get(w.address) is w  # its call is still running
        w.calls.discard(call)  # the last message arrived
        await asyncio.wait_for(removal, 1.0)
        assert w.address not in pool.workers
        task.cancel()
        pool.suspect(w)  # the retry path of a request that failed on it
        assert w.address not in pool._suspected

        stub = _Stub()
        stub.load_answers = stub.health_answers = False
        pool, w, call, task = _start(stub)
        await _until(lambda: w.cut_off)  # silent: its calls will never end here
        t0 = asyncio.get_running_loop().time()
        await pool.remove(w.address, grace_s=5.0)
        assert asyncio.get_running_loop().time() - t0 < 1.0 and w.address not in pool.workers
        task.cancel()

    asyncio.run(scenario())


def test_dead_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="dead_after_s"):
        WorkerPool([], dead_after_s=0)
