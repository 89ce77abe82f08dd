"""A worker on its way out answers ``Health`` with NOT_SERVING before its process exits, so routers stop sending.

Real ``tandem worker`` processes, asked by a gRPC ``Health`` client. Two ways out: a SIGTERM drain (held open by a
prefill transfer that the fault injection ``--debug-transfer-delay-ms`` keeps in flight for 1.5 s), and a TP=2
replica whose rank 1 is killed with SIGKILL (the worker exits 3 after ``RANK_EXIT_GRACE_S``).
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
import pytest

from auth.token import bearer, ensure_cluster_token
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "64", "--threads", "1", "--session-port", "-1"]


def _statuses_until_exit(worker: WorkerProcess, timeout_s: float) -> tuple[list[str], int]:
    """Every ``Health`` status the worker answered until its process ended, and its exit code."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(worker.address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        while worker.proc.poll() is None and time.monotonic() < deadline:
            try:
                h = stub.Health(pb.HealthRequest(), timeout=1.0)
            except grpc.RpcError:
                time.sleep(0.02)
                continue
            if not seen or seen[-1] != h.status:
                seen.append(h.status)
            time.sleep(0.02)
    try:
        return seen, worker.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit; Health said {seen}")


def test_sigterm_drain_answers_not_serving_until_the_process_exits(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    prefill = start_worker("prefill", str(path), "tcp", [*FLAGS, "--debug-transfer-delay-ms", "1500"])
    decode = start_worker("decode", str(path), "tcp", FLAGS)
    try:
        prompt = [random.Random(1).randrange(1, 2000) for _ in range(40)]
        params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with grpc.insecure_channel(prefill.address) as pch, grpc.insecure_channel(decode.address) as dch:
            pre, dec = pb_grpc.WorkerStub(pch), pb_grpc.WorkerStub(dch)
            assert pre.Health(pb.HealthRequest(), timeout=5).status == "SERVING"
            res = dec.Reserve(pb.ReserveRequest(request_id="r", prompt_token_ids=prompt, params=params,
                                                lease_ms=30_000), timeout=30)
            pre.Prefill(pb.PrefillRequest(request_id="r", prompt_token_ids=prompt, params=params,
                                          destination=res.destination, lease_ms=30_000), timeout=30)
        prefill.proc.send_signal(signal.SIGTERM)  # the transfer keeps the drain open for ~1.5 s
        seen, code = _statuses_until_exit(prefill, 30)
        assert code == 0
        # SERVING only in the moment before the signal handler ran; from then on NOT_SERVING until the exit
        assert seen in (["NOT_SERVING"], ["SERVING", "NOT_SERVING"]), f"Health said {seen}"
        # what a router does with a request that ends before its Decode call: release the decode side's reservation
        # (else the decode worker's own SIGTERM drain below waits out the 30 s lease, past stop()'s 10 s)
        with grpc.insecure_channel(decode.address) as dch:
            pb_grpc.WorkerStub(dch).Abort(pb.AbortRequest(request_id="r"), timeout=10,
                                          metadata=[("authorization", bearer(ensure_cluster_token()))])
    finally:
        prefill.stop()
        decode.stop()


def test_a_dead_rank_answers_not_serving_before_the_worker_exits(checkpoint: Callable[[str], Path]) -> None:
    worker = start_worker("both", str(checkpoint("llama")), "tcp", [*FLAGS, "--tp", "2"], timeout_s=300)
    try:
        ranks = [c for c in psutil.Process(worker.proc.pid).children()
                 if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(ranks) == 1
        with grpc.insecure_channel(worker.address) as ch:
            assert pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5).status == "SERVING"
        ranks[0].kill()
        seen, code = _statuses_until_exit(worker, 60)
        assert code == 3
        assert seen in (["NOT_SERVING"], ["SERVING", "NOT_SERVING"]), f"Health said {seen}"
    finally:
        worker.stop(timeout=30)
