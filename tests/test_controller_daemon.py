"""``tandem controller`` as its own process, as in a Ray head pod: a local Ray it starts, a real redis-server as the
worker registry, real worker processes; driven through its Control gRPC API."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from auth.credentials import Credentials
from auth.grpc_client import attach
from auth.signing import verify
from auth.token import new_token
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leases(client: redis.Redis, token: str) -> dict[str, bool]:
    """address -> draining, for every correctly signed worker lease in the registry."""
    out = {}
    for key in client.scan_iter(match="tandem:*:worker:*"):
        raw = client.get(key)
        if raw:
            entry = verify(raw, token)
            out[str(entry["address"])] = bool(entry["draining"])
    return out


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_tandem_controller_registers_in_redis_scales_and_stops_on_sigterm(checkpoint: Callable[[str], Path],
                                                                          tmp_path: Path) -> None:
    """A replica is READY only once its signed lease is in Redis; SetReplicas 1 -> 2 -> 1 keeps Status and the
    registry in step (the drained replica's lease goes); SIGTERM stops every worker (no lease left) and exits 0."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    rport, cport = _free_port(), _free_port()
    redis_proc = subprocess.Popen([exe, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                   "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    token = new_token()
    env = {**os.environ, "TANDEM_CLUSTER_TOKEN": token, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    ctl = subprocess.Popen([sys.executable, "-m", "cli.main", "controller", "--model", str(checkpoint("llama")),
                            "--redis", f"redis://127.0.0.1:{rport}", "--prefill", "0", "--decode", "1",
                            "--control-port", str(cport), "--host", "127.0.0.1", "--worker-host", "127.0.0.1",
                            "--kv-backend", "tcp", "--cpus-per-replica", "0.25", "--drain-timeout", "30"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    client = redis.Redis(port=rport)
    assert ctl.stdout is not None
    threading.Thread(target=ctl.stdout.read, daemon=True).start()  # keep its log pipe drained
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{cport}")
        control = attach(cpb_grpc.ControlStub(channel), Credentials(token))  # SetReplicas needs the token

        def decode() -> cpb.TierStatus:
            return next(t for t in control.Status(cpb.StatusRequest(), timeout=10).tiers if t.tier == "decode")

        def converged(n: int) -> bool:
            try:
                t = decode()
            except grpc.RpcError:
                return False
            return (t.desired, t.ready, t.starting, t.draining, len(t.replicas)) == (n, n, 0, 0, n)

        _wait(lambda: converged(1), "one ready decode replica")
        (first,) = decode().replicas
        assert _leases(client, token) == {first.address: False}  # registered before it counted as ready

        control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=2), timeout=10)
        _wait(lambda: converged(2), "two ready decode replicas")
        assert set(_leases(client, token)) == {r.address for r in decode().replicas}

        control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=1), timeout=10)
        _wait(lambda: converged(1), "back to one decode replica")
        (left,) = decode().replicas
        _wait(lambda: set(_leases(client, token)) == {left.address}, "the drained replica's lease to go", 30)

        ctl.send_signal(signal.SIGTERM)
        assert ctl.wait(90) == 0
        _wait(lambda: not _leases(client, token), "every worker's lease to go", 30)
        channel.close()
    finally:
        if ctl.poll() is None:
            os.killpg(ctl.pid, signal.SIGKILL)
            ctl.wait(10)
        client.close()
        redis_proc.kill()
        redis_proc.wait(10)
