"""``tandem scale`` against a running ``tandem up`` (a real process: local Ray, worker processes, router), and a
decode worker killed with SIGKILL while requests run: the controller replaces it and no request fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest

from auth.token import new_token
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tandem(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=240)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_tandem_scale_a_running_tandem_up_and_replace_a_killed_worker(checkpoint: Callable[[str], Path],
                                                                       tmp_path: Path) -> None:
    """``tandem scale decode 2`` converges and prints the tier; SIGKILL of one decode worker while two clients
    send requests: every request succeeds, and a new replica (restarts 1) takes its place; bad input to
    ``tandem scale`` exits 2, and so does a wrong cluster token (1) or none (UNAUTHENTICATED); ``tandem down``
    leaves no worker behind."""
    model = checkpoint("llama")
    # No token in the environment: `tandem up` makes one, and `tandem scale` must find it in the token file.
    env = {**{k: v for k, v in os.environ.items() if k != "TANDEM_CLUSTER_TOKEN"}, "TANDEM_HOME": str(tmp_path),
           "RAY_AUTH_MODE": "disabled"}
    port = _free_port()
    # --threads 1: this cluster grows to two replicas, which the one replica's default (every core) would oversubscribe
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--model", str(model), "--prefill", "0",
                           "--decode", "1", "--port", str(port), "--grpc-port", "-1", "--threads", "1"],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    pids: set[int] = set()
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 180
        while not any("serving OpenAI API at" in line for line in lines):
            line = up.stdout.readline()
            assert line or up.poll() is None, "tandem up exited:\n" + "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "tandem up did not start:\n" + "".join(lines)
        threading.Thread(target=lambda: lines.extend(up.stdout or ()), daemon=True).start()  # keep the pipe drained

        scaled = _tandem(env, "scale", "decode", "2", "--wait", "180", "--json")
        assert scaled.returncode == 0, scaled.stderr
        tier = json.loads(scaled.stdout)
        assert (tier["tier"], tier["desired"], tier["ready"], len(tier["replicas"])) == ("decode", 2, 2, 2)
        assert _tandem(env, "scale", "decode", "-1").returncode == 2
        assert _tandem(env, "scale", "router", "1").returncode == 2

        state = json.loads((tmp_path / "up.json").read_text())
        # SetReplicas needs the cluster token: `tandem scale` read it from the 0600 file beside the state file;
        # another token, or none at all, is refused and changes nothing.
        token_file = Path(state["token_file"])
        assert token_file.parent == tmp_path and token_file.stat().st_mode & 0o777 == 0o600
        wrong = _tandem({**env, "TANDEM_CLUSTER_TOKEN": new_token()}, "scale", "decode", "1")
        assert wrong.returncode == 1 and "wrong cluster token" in wrong.stderr
        anonymous = cpb_grpc.ControlStub(grpc.insecure_channel(state["control"]))
        with pytest.raises(grpc.RpcError) as refused:
            anonymous.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        pids.update(state["worker_pids"])
        assert len(pids) == 2
        victim = sorted(pids)[0]
        control = cpb_grpc.ControlStub(grpc.insecure_channel(state["control"]))

        ok, failed, stop = [0], list[str](), threading.Event()

        def client(i: int) -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                for n in range(500):  # bounded: ~0.1 s each, and stopped once the replacement serves
                    if stop.is_set():
                        return
                    r = c.post("/v1/completions", json={"model": model.name, "prompt": [5 + i, 6 + n % 40, 7],
                                                        "max_tokens": 16, "temperature": 0, "ignore_eos": True})
                    if r.status_code == 200:
                        ok[0] += 1
                    else:
                        failed.append(f"{r.status_code} {r.text[:200]}")

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
        for t in clients:
            t.start()
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            (dec,) = [t for t in control.Status(cpb.StatusRequest(), timeout=10).tiers if t.tier == "decode"]
            if dec.ready == 2 and any(r.restarts == 1 for r in dec.replicas):
                break
            assert time.monotonic() < deadline, f"the killed replica was not replaced: {dec}"
            time.sleep(0.5)
        served_before = ok[0]
        time.sleep(2.0)  # requests on the replacement as well
        stop.set()
        for t in clients:
            t.join(60)
        assert not failed, f"{len(failed)} failed requests, e.g. {failed[:3]}"
        assert ok[0] > served_before > 0
        pids.update(json.loads((tmp_path / "up.json").read_text())["worker_pids"])
        assert len(pids) == 3  # the replacement is a new process
        (dec,) = [t for t in control.Status(cpb.StatusRequest(), timeout=10).tiers if t.tier == "decode"]
        assert dec.desired == 2  # neither refused call changed it

        down = _tandem(env, "down")
        assert down.returncode == 0, down.stderr
        assert up.wait(60) == 0
        assert not token_file.exists()  # tandem up takes its token file with it
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "worker processes left behind"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
