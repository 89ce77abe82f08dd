"""The controller's ``tandem.v1.Control`` API behind the cluster token and mutual TLS: a real grpc.aio server on
127.0.0.1 around a real :class:`Controller` whose reconcile loop is not started (no Ray is needed to accept or
refuse a call; ``SetReplicas`` changes the desired count, which is all it does before the loop runs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from auth.credentials import Credentials
from auth.dev_certs import DevCA
from auth.grpc_client import aio_channel, attach
from auth.token import new_token
from controlplane.control_server import start_control_server
from controlplane.controller import Controller, ControllerConfig
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc


async def _codes(server_creds: Credentials, client_creds: Credentials) -> dict[str, grpc.StatusCode]:
    """Each Control RPC's status code as ``client_creds`` sees it, and the desired decode count afterwards."""
    controller = Controller(ControllerConfig("/m", prefill=0, decode=1), credentials=server_creds)
    server, port = await start_control_server(controller, "127.0.0.1", 0)
    out: dict[str, grpc.StatusCode] = {}
    try:
        async with aio_channel(f"127.0.0.1:{port}", client_creds) as ch:
            stub = attach(cpb_grpc.ControlStub(ch), client_creds)
            calls = {"SetReplicas": lambda: stub.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=3),
                                                             timeout=10),
                     "Drain": lambda: stub.Drain(cpb.DrainReplicaRequest(replica_id="decode-nope"), timeout=10),
                     "Status": lambda: stub.Status(cpb.StatusRequest(), timeout=10)}
            for name, call in calls.items():
                try:
                    await call()
                    out[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    out[name] = e.code()
    finally:
        await server.stop(None)
    out["desired"] = controller.desired["decode"]  # type: ignore[assignment]
    return out


def test_set_replicas_and_drain_are_refused_without_the_token_or_with_a_wrong_one_and_status_stays_open() -> None:
    token = new_token()
    anonymous = asyncio.run(_codes(Credentials(token), Credentials(None)))
    assert anonymous == {"SetReplicas": grpc.StatusCode.UNAUTHENTICATED, "Drain": grpc.StatusCode.UNAUTHENTICATED,
                         "Status": grpc.StatusCode.OK, "desired": 1}
    wrong = asyncio.run(_codes(Credentials(token), Credentials(new_token())))
    assert wrong == anonymous


def test_set_replicas_and_drain_are_accepted_with_the_token() -> None:
    token = new_token()
    got = asyncio.run(_codes(Credentials(token), Credentials(token)))
    # Drain gets past the guard to the servicer, which finds no such replica.
    assert got == {"SetReplicas": grpc.StatusCode.OK, "Drain": grpc.StatusCode.NOT_FOUND,
                   "Status": grpc.StatusCode.OK, "desired": 3}


def test_a_controller_without_a_token_refuses_admin_calls_to_everyone() -> None:
    got = asyncio.run(_codes(Credentials(None), Credentials(new_token())))
    assert (got["SetReplicas"], got["Drain"], got["Status"]) == (grpc.StatusCode.PERMISSION_DENIED,
                                                                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK)


def test_with_tls_files_the_control_port_is_mutual_tls(tmp_path: Path) -> None:
    """A client with a certificate from the cluster's CA and the token is served (over the cluster-wide server
    name, as in Kubernetes); one without a certificate, or with another CA's, fails the handshake on every RPC."""
    ca = DevCA.create(tmp_path / "ca")
    token = new_token()
    server = Credentials(token, ca.issue(tmp_path / "server", "controller", dns_names=("tandem",)))
    client = Credentials(token, ca.issue(tmp_path / "client", "operator", server_name="tandem"))
    ok = asyncio.run(_codes(server, client))
    assert ok == {"SetReplicas": grpc.StatusCode.OK, "Drain": grpc.StatusCode.NOT_FOUND,
                  "Status": grpc.StatusCode.OK, "desired": 3}
    plaintext = asyncio.run(_codes(server, Credentials(token)))
    assert {plaintext[k] for k in ("SetReplicas", "Drain", "Status")} == {grpc.StatusCode.UNAVAILABLE}
    assert plaintext["desired"] == 1
    other = DevCA.create(tmp_path / "other", name="someone-else")
    stranger = Credentials(token, other.issue(tmp_path / "stranger", "stranger", server_name="tandem"))
    refused = asyncio.run(_codes(server, stranger))
    assert {refused[k] for k in ("SetReplicas", "Drain", "Status")} == {grpc.StatusCode.UNAVAILABLE}


@pytest.mark.parametrize("flags", [["--tls-cert", "/nope"], ["--tls-server-name", "tandem"]])
def test_tandem_scale_refuses_an_incomplete_tls_flag_set_with_exit_code_2(flags: list[str], tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cli.main", "scale", "decode", "2", "--control", "127.0.0.1:1",
                          *flags], capture_output=True, text=True, timeout=60,
                         env={"TANDEM_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "--tls-" in out.stderr
