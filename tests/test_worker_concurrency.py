"""A decode worker carries 512 concurrent ``Decode`` streams: its gRPC server (``grpc.aio``, worker/aio_service.py)
holds no thread per stream, where the thread-per-call server it replaced stopped at its 64-thread pool.

Real ``tandem worker`` processes (a prefill and a decode, KV over TCP on loopback) and a real grpc.aio client.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
STREAMS = 512
MAX_NEW = 48
FLAGS = ["--num-kv-blocks", "3072", "--threads", "1", "--max-num-seqs", str(STREAMS)]


def _params() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_512_concurrent_decode_streams_all_run_at_once_exactly_and_free_every_block(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """512 requests are reserved and prefilled, then their 512 Decode streams are opened at once. Every stream gets
    its first chunk before any stream ends (all 512 are served together, in one running batch: a 64-thread server
    would serve 64 and queue the rest behind them), every one completes with MAX_NEW tokens, a sample equals
    transformers token for token, and no block is left held on either worker."""
    path = checkpoint("llama")
    prefill = start_worker("prefill", str(path), "tcp", FLAGS)
    decode = start_worker("decode", str(path), "tcp", FLAGS)
    rng = random.Random(512)
    prompts = [[rng.randrange(1, 2000) for _ in range(12)] for _ in range(STREAMS)]
    try:
        async def run() -> tuple[list[list[int]], list[float], list[float], pb.LoadResponse, pb.LoadResponse]:
            opts = [("grpc.max_receive_message_length", 64 << 20)]
            async with grpc.aio.insecure_channel(prefill.address, options=opts) as pch, \
                    grpc.aio.insecure_channel(decode.address, options=opts) as dch:
                pre, dec = pb_grpc.WorkerStub(pch), pb_grpc.WorkerStub(dch)

                async def handoff(i: int) -> pb.DecodeRequest:
                    rid = f"c{i}"
                    res = await dec.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompts[i],
                                                              params=_params(), lease_ms=120_000), timeout=120)
                    first = await pre.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompts[i],
                                                                params=_params(), destination=res.destination,
                                                                lease_ms=120_000), timeout=120)
                    return pb.DecodeRequest(request_id=rid, first_token_id=first.first_token_id)

                reqs = await asyncio.gather(*(handoff(i) for i in range(STREAMS)))
                firsts: list[float] = []
                lasts: list[float] = []

                async def stream(req: pb.DecodeRequest) -> list[int]:
                    out: list[int] = []
                    async for chunk in dec.Decode(req, timeout=300):
                        if not out:
                            firsts.append(time.monotonic())
                        out.extend(chunk.token_ids)
                        if chunk.finish_reason:
                            lasts.append(time.monotonic())
                    return out

                outs = await asyncio.gather(*(stream(r) for r in reqs))
                loads = []
                for stub in (pre, dec):
                    deadline = time.monotonic() + 30
                    while True:
                        ld = await stub.Load(pb.LoadRequest(), timeout=10)
                        if (ld.used_blocks == 0 and ld.held_blocks == 0 and ld.running == 0
                                and ld.waiting_for_kv == 0) or time.monotonic() > deadline:
                            break
                        await asyncio.sleep(0.1)
                    loads.append(ld)
                return outs, firsts, lasts, loads[0], loads[1]

        outs, firsts, lasts, pre_load, dec_load = asyncio.run(run())
        assert len(outs) == STREAMS and all(len(o) == MAX_NEW for o in outs)
        assert len(firsts) == STREAMS and max(firsts) < min(lasts), "some streams waited for others to end"
        for i in (0, 255, 511):
            assert outs[i] == hf_greedy(path, prompts[i], MAX_NEW), f"stream {i} differs from transformers"
        for name, ld in (("prefill", pre_load), ("decode", dec_load)):
            assert ld.used_blocks == 0 and ld.held_blocks == 0 and ld.transfers_in_flight == 0, f"{name}: {ld}"
            assert ld.running == 0 and ld.waiting_for_kv == 0 and ld.free_blocks == ld.total_blocks, f"{name}: {ld}"
    finally:
        prefill.stop()
        decode.stop()
