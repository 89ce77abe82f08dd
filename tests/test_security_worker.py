"""The worker's gRPC API without TLS (loopback ``tandem up``): the admin RPCs need the cluster token.

A real ``tandem worker`` holding this test process's cluster token (inherited through the environment, as
``tandem up``'s workers inherit theirs): ``Drain``, ``Snapshot``, ``Abort`` and ``KVEvents`` are refused without
the token and with a wrong one, and served with it through ``auth.grpc_client.attach``; a worker started with no
token refuses them to everyone. ``Health`` names the model without its filesystem path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from auth.credentials import Credentials
from auth.grpc_client import attach
from auth.token import TOKEN_ENV, new_token
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import WorkerProcess, start_worker

FLAGS = ["--num-kv-blocks", "64", "--threads", "1", "--session-port", "-1"]
ADMIN_CALLS: dict[str, Callable[[pb_grpc.WorkerStub, Any], Any]] = {
    "Drain": lambda s, md: s.Drain(pb.DrainRequest(), timeout=10, metadata=md),
    "Snapshot": lambda s, md: s.Snapshot(pb.SnapshotRequest(), timeout=10, metadata=md),
    "Abort": lambda s, md: s.Abort(pb.AbortRequest(request_id="nobody"), timeout=10, metadata=md),
    "KVEvents": lambda s, md: next(iter(s.KVEvents(pb.KVEventsRequest(), timeout=10, metadata=md))),
}


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path]) -> Iterator[WorkerProcess]:
    w = start_worker("both", str(checkpoint("llama")), "tcp", FLAGS)
    yield w
    w.stop()


def _refused(address: str, name: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        ADMIN_CALLS[name](pb_grpc.WorkerStub(ch), metadata)
    code: grpc.StatusCode = err.value.code()  # type: ignore[attr-defined]
    return code


@pytest.mark.parametrize("name", sorted(ADMIN_CALLS))
def test_admin_rpc_without_a_token_is_refused_unauthenticated(worker: WorkerProcess, name: str) -> None:
    assert _refused(worker.address, name, ()) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("name", sorted(ADMIN_CALLS))
def test_admin_rpc_with_a_wrong_token_is_refused_unauthenticated(worker: WorkerProcess, name: str) -> None:
    wrong = Credentials(new_token()).metadata
    assert _refused(worker.address, name, wrong) == grpc.StatusCode.UNAUTHENTICATED
    assert _refused(worker.address, name, (("authorization", "Basic xyz"),)) == grpc.StatusCode.UNAUTHENTICATED


def test_admin_rpcs_with_the_cluster_token_are_served_and_data_rpcs_stay_open(worker: WorkerProcess) -> None:
    with grpc.insecure_channel(worker.address) as ch:
        stub = attach(pb_grpc.WorkerStub(ch), Credentials.for_cluster())
        snap = stub.Snapshot(pb.SnapshotRequest(), timeout=10)
        assert snap.worker_id and snap.seq >= 0
        assert stub.Abort(pb.AbortRequest(request_id="nobody"), timeout=10).found is False
        # A caller's own metadata rides along with the token.
        assert stub.Abort(pb.AbortRequest(request_id="x"), timeout=10, metadata=(("x-trace", "1"),)).found is False
        plain = pb_grpc.WorkerStub(ch)
        assert plain.Load(pb.LoadRequest(), timeout=10).total_blocks == 64
        chunks = list(plain.Generate(pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2, 3],
                                                        params=pb.SamplingParams(max_tokens=2, temperature=0)),
                                     timeout=60))
        assert chunks[-1].finish_reason


def test_health_names_the_model_and_not_its_path(worker: WorkerProcess, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    with grpc.insecure_channel(worker.address) as ch:
        h = pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10)
    assert h.model == path.name
    assert "/" not in h.model and str(path.parent) not in str(h)


def test_a_worker_without_a_token_refuses_admin_rpcs_to_everyone(checkpoint: Callable[[str], Path]) -> None:
    w = start_worker("both", str(checkpoint("llama")), "tcp", FLAGS, env={TOKEN_ENV: ""})
    try:
        assert "no cluster token" in "".join(w.log)
        for name in ("Drain", "Snapshot"):
            assert _refused(w.address, name, Credentials.for_cluster().metadata) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        w.stop()
