"""Busy is never dead: a saturated worker still answers its probes, so the router's pool cuts off nothing, while a
worker that really stopped (SIGSTOP: its connections stay open, nothing comes back) is still cut off.

A real ``tandem worker`` process and the router's real :class:`~router.pool.WorkerPool` (its probes, its cut-off
rule with ``dead_after_s`` = 1 s, far below the 13 s of silence a busy thread-pool worker once showed), driven by a
real grpc.aio client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.pool import WorkerPool
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
STREAMS = 300
MAX_NEW = 96


def test_a_saturated_worker_is_never_cut_off_and_a_stopped_one_is(checkpoint: Callable[[str], Path]) -> None:
    """300 concurrent streams of 96 tokens keep one worker's engine busy on 2 cores (far past the 64 streams that
    once took every thread of its gRPC pool, after which Health queued behind them). Throughout, the pool's
    probes are answered: 0 cut-offs, and a side probe's Health never waits more than a second. Every stream
    completes. Then the worker is SIGSTOPped: the pool cuts it off within seconds."""
    path = checkpoint("llama")
    w = start_worker("decode", str(path), "tcp", ["--num-kv-blocks", "4096", "--threads", "1",
                                                   "--max-num-seqs", str(STREAMS)])
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 2000) for _ in range(16)] for _ in range(STREAMS)]
    stopped = False
    try:
        async def run() -> tuple[int, float, list[int], float]:
            pool = WorkerPool([w.address], poll_interval_s=0.2, dead_after_s=1.0)
            await pool.start()
            worker = pool.workers[w.address]
            try:
                async with grpc.aio.insecure_channel(w.address) as ch:
                    stub = pb_grpc.WorkerStub(ch)
                    done = asyncio.Event()
                    worst = 0.0

                    async def probe() -> None:
                        nonlocal worst
                        while not done.is_set():
                            t0 = time.monotonic()
                            await stub.Health(pb.HealthRequest(), timeout=10)
                            worst = max(worst, time.monotonic() - t0)
                            await asyncio.sleep(0.1)

                    async def one(i: int) -> int:
                        n = 0
                        req = pb.GenerateRequest(request_id=f"busy-{i}", prompt_token_ids=prompts[i],
                                                 params=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                          ignore_eos=True))
                        async for chunk in stub.Generate(req, timeout=600):
                            n += len(chunk.token_ids)
                        return n

                    prober = asyncio.create_task(probe())
                    counts = await asyncio.gather(*(one(i) for i in range(STREAMS)))
                    done.set()
                    await prober
                    cutoffs = worker.cutoffs
                    nonlocal stopped
                    os.kill(w.proc.pid, signal.SIGSTOP)
                    stopped = True
                    t0 = time.monotonic()
                    while not worker.cut_off and time.monotonic() - t0 < 30:
                        await asyncio.sleep(0.1)
                    took = time.monotonic() - t0 if worker.cut_off else float("inf")
                    return cutoffs, worst, counts, took
            finally:
                await pool.close()

        cutoffs, worst, counts, took = asyncio.run(run())
        print(f"busy: {cutoffs} cut-offs, worst Health {worst * 1000:.0f} ms; stopped: cut off after {took:.1f}s")
        assert counts == [MAX_NEW] * STREAMS
        assert cutoffs == 0, "a busy worker was taken for a dead one"
        assert worst < 1.0, f"Health took {worst:.2f}s while the engine was busy"
        assert took < 15, f"the stopped worker was cut off after {took:.1f}s"
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGCONT)
        w.stop()
