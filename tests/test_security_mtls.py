"""Mutual TLS between the router and the workers: real processes with certificates from a throwaway CA.

A prefill and a decode ``tandem worker`` started with ``--tls-cert/--tls-key/--tls-ca`` and a real router holding
its own certificate from the same CA serve a disaggregated and a colocated request token-exact with transformers,
the colocated one on the worker's TCP session port, itself under TLS. Refused: a gRPC client that speaks plaintext,
presents no certificate, or one from another CA; the same on the session port; and, over a good mTLS channel, an
admin RPC that lacks the cluster token.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from gateway_harness import RouterThread

from auth.credentials import Credentials, to_flags
from auth.dev_certs import DevCA
from auth.grpc_client import attach
from auth.grpc_client import channel as tls_channel
from auth.tls import TLSFiles, client_context, grpc_channel_credentials
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.server import RouterConfig
from wire.framing import frame
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "256", "--threads", "1"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TLSFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = DevCA.create(d / "ca"), DevCA.create(d / "other", "other-ca")
    return {"prefill": ca.issue(d, "prefill"), "decode": ca.issue(d, "decode"), "router": ca.issue(d, "router"),
            "foreign": other.issue(d / "foreign", "intruder")}


@pytest.fixture(scope="module")
def workers(pki: dict[str, TLSFiles], checkpoint: Callable[[str], Path]) -> Iterator[dict[str, WorkerProcess]]:
    path = str(checkpoint("llama"))
    started: dict[str, WorkerProcess] = {}
    try:
        for role in ("prefill", "decode"):
            started[role] = start_worker(role, path, "tcp", [*FLAGS, "--worker-id", f"tls-{role}",
                                                             *to_flags(Credentials(tls=pki[role]))])
        yield started
    finally:
        for w in started.values():
            w.stop()


def test_router_and_workers_over_mtls_serve_token_exact(workers: dict[str, WorkerProcess], pki: dict[str, TLSFiles],
                                                        checkpoint: Callable[[str], Path], hf_greedy: Any) -> None:
    path = checkpoint("llama")
    rt = RouterThread(RouterConfig(model=str(path), workers=tuple(w.address for w in workers.values()),
                                   credentials=Credentials.for_cluster(pki["router"])))
    try:
        rng = random.Random(5)
        for n_prompt, mode in ((120, "disaggregated"), (12, "colocated")):
            prompt = [rng.randrange(2000) for _ in range(n_prompt)]
            r = httpx.post(rt.url + "/v1/completions", json={"model": path.name, "prompt": prompt, "max_tokens": 8,
                                                             "temperature": 0, "ignore_eos": True},
                           headers={"x-tandem-explain": "1"}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.headers["x-tandem-route"].startswith(mode), r.headers["x-tandem-route"]
            from engine.tokenizer import Tokenizer

            assert r.json()["choices"][0]["text"] == Tokenizer(path).decode(hf_greedy(path, prompt, 8))
        sessions = rt.call(lambda r: {w.worker_id: (w.session.tcp, w.session.unreachable, w.session.opened)
                                      for w in r.pool.workers.values() if w.session is not None})
        tcp, unreachable, opened = sessions["tls-decode"]
        assert tcp is not None and unreachable is None and opened == 1  # the colocated request went over TLS TCP
    finally:
        rt.stop()


def _health(address: str, creds: grpc.ChannelCredentials | None) -> None:
    ch = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
    with ch:
        pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5)


def test_grpc_refuses_plaintext_no_certificate_and_a_foreign_certificate(workers: dict[str, WorkerProcess],
                                                                         pki: dict[str, TLSFiles]) -> None:
    address = workers["decode"].address
    _health(address, grpc_channel_credentials(pki["router"]))  # the cluster's certificate: answered
    ca = Path(pki["router"].ca).read_bytes()
    for creds in (None, grpc.ssl_channel_credentials(root_certificates=ca), grpc_channel_credentials(
            TLSFiles(pki["foreign"].cert, pki["foreign"].key, pki["router"].ca))):
        with pytest.raises(grpc.RpcError) as err:
            _health(address, creds)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_admin_rpc_over_mtls_still_needs_the_cluster_token(workers: dict[str, WorkerProcess],
                                                           pki: dict[str, TLSFiles]) -> None:
    with tls_channel(workers["decode"].address, Credentials(tls=pki["router"])) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.WorkerStub(ch).Snapshot(pb.SnapshotRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        snap = attach(pb_grpc.WorkerStub(ch), Credentials.for_cluster()).Snapshot(pb.SnapshotRequest(), timeout=10)
        assert snap.worker_id == "tls-decode"


def _session_port(address: str, pki: dict[str, TLSFiles]) -> int:
    with tls_channel(address, Credentials(tls=pki["router"])) as ch:
        return int(pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10).session_port)


def _request() -> bytes:
    g = pb.GenerateRequest(request_id="intruder", prompt_token_ids=[1, 2, 3],
                           params=pb.SamplingParams(max_tokens=2, temperature=0))
    return frame(pb.SessionRequest(generate=[g]).SerializeToString())


def _answer(sock: socket.socket) -> bytes:
    """What the worker sends back within 10 s (b"" if it closed the connection)."""
    sock.settimeout(10)
    try:
        return sock.recv(1 << 16)
    except (ConnectionError, ssl.SSLError):
        return b""


def test_session_port_refuses_plaintext_and_a_foreign_certificate(workers: dict[str, WorkerProcess],
                                                                  pki: dict[str, TLSFiles]) -> None:
    port = _session_port(workers["decode"].address, pki)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(_request())
        assert _answer(plain) == b""
    foreign = client_context(TLSFiles(pki["foreign"].cert, pki["foreign"].key, pki["router"].ca))
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            contextlib.suppress(ssl.SSLError, ConnectionError), \
            foreign.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(_request())
        answer = _answer(tls)
    assert answer == b""
    # The cluster's own certificate gets its answer on the same port.
    good = client_context(pki["router"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            good.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(_request())
        assert _answer(tls) != b""
