"""A process busy in gRPC that forks a child (subprocess with ``preexec_fn``, which forks rather than vforks, as
``worker.launcher.start_worker`` does to pin a worker's CPUs) must not lose the child before it execs.

grpcio >= 1.81 aborts such a child in gRPC's poller now and then (grpc/grpc#43055: ``epoll_wait error: Bad file
descriptor``, SIGABRT; 7-9 of 300 forks on this VM, once a prefill worker in CI). Every ``tandem`` process turns
gRPC's fork support off when ``cli.main`` is imported, before grpc is; this runs the forks in a fresh interpreter
that imports ``cli.main`` first, as the ``tandem`` entry point does, with a real gRPC server and client busy on
loopback throughout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FORKS = 300

SCRIPT = """
import subprocess, sys, threading, time
import cli.main  # what the tandem entry point imports first
import grpc
from concurrent import futures

server = grpc.server(futures.ThreadPoolExecutor(4))
echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Echo": echo}),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/t.Echo/Echo")
done = threading.Event()
calls = 0

def busy():
    global calls
    while not done.is_set():
        call(b"x", timeout=10)
        calls += 1

threading.Thread(target=busy, daemon=True).start()
failed, deadline = [], time.monotonic() + 90
for _ in range(int(sys.argv[1])):
    run = subprocess.run(["true"], capture_output=True, text=True, preexec_fn=lambda: None, timeout=30)
    if run.returncode != 0:
        failed.append((run.returncode, run.stderr[-200:]))
    if time.monotonic() > deadline:
        break
done.set()
print(len(failed), calls, failed[:2])
"""


def test_children_forked_while_grpc_is_busy_all_reach_exec() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # what cli.main sets, only
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(FORKS)], capture_output=True, text=True, timeout=180,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    failed, calls, examples = done.stdout.split(maxsplit=2)
    assert int(calls) > 0, "the gRPC client never completed a call while the children were forked"
    assert failed == "0", f"{failed} of {FORKS} forked children died before exec: {examples}"
