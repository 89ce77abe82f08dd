"""``python -m router.serve``: a standalone router in front of given workers, in one process or several.

One process: build the router (tokenizer, worker pool, KV index following every worker's event stream), bind the
HTTP gateway (and with ``--grpc-port`` the client gRPC API, ``proto/tandem/v1/gateway.proto``, announced by a
``GRPC <port>`` line), freeze the start-up heap out of the GC's way, print ``READY <port>``, serve until
SIGTERM/SIGINT.

``--processes N`` (> 1): this process only supervises. It starts N one-process routers on the same port with
``SO_REUSEPORT`` (the kernel spreads incoming connections across them): the first binds the port (a free one if
``--port 0``), the others join it. Each is a full router that follows the same workers and so builds its own KV
index from the same events, the same index. The load each one books is its own; every router still sees the
others' work through the workers' ``Load`` reports. Once every child is ready the supervisor prints one
``READY <port>``; a signal stops them all, and the supervisor exits when any child dies.

Run: ``python -m router.serve --model DIR --workers 127.0.0.1:7001,127.0.0.1:7002 --port 8000 --processes 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReadyProcess:
    """A child process that prints ``READY <port>`` on stdout once it serves; its stderr is kept (tail only)."""

    name: str
    proc: subprocess.Popen[str]
    port: int = 0
    grpc_port: int = 0  # from a ``GRPC <port>`` line, printed before READY by a router given --grpc-port
    log: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, cmd: list[str], timeout_s: float = 60.0,
              env: dict[str, str] | None = None) -> ReadyProcess:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self = cls(name, proc)
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        ready = threading.Event()

        def read_stdout() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not ready.is_set() and line.startswith("GRPC "):
                    self.grpc_port = int(line.split()[1])
                if not ready.is_set() and line.startswith("READY "):
                    self.port = int(line.split()[1])
                    ready.set()
            ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        if not ready.wait(timeout_s) or not self.port:
            self.stop(timeout=2.0)
            raise RuntimeError(f"{name} not ready within {timeout_s:.0f}s (exit {proc.poll()}):\n{self.tail()}")
        return self

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if len(self.log) > 400:
                del self.log[:100]

    def tail(self, lines: int = 40) -> str:
        return "".join(self.log[-lines:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint dir (tokenizer and config only)")
    p.add_argument("--workers", default="", help="comma-separated worker addresses host:port")
    p.add_argument("--redis", default=None, help="redis://... to discover workers and follow the shared KV stream")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the READY line)")
    p.add_argument("--processes", type=int, default=1, help="router processes sharing the port (SO_REUSEPORT)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the client gRPC API (tandem.v1.Gateway) here; 0 picks a free port (GRPC line)")
    p.add_argument("--min-uncached-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (hashes must agree)")
    p.add_argument("--worker-dead-after", type=float, default=10.0, metavar="S",
                   help="fail over every request on a worker that answers no probe for S seconds")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set on a supervisor's children


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, handled by the running loop: how every long-running Tandem process
    (router, ``tandem up``, the bench's fake backends) waits for its end."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_one(args: argparse.Namespace) -> int:
    from router.server import RouterConfig, build_router

    workers = tuple(a for a in args.workers.split(",") if a)
    router = await build_router(RouterConfig(model=args.model, workers=workers, redis=args.redis,
                                             served_model_name=args.served_model_name,
                                             min_uncached_tokens=args.min_uncached_tokens,
                                             block_size=args.block_size,
                                             worker_dead_after_s=args.worker_dead_after))
    port = await router.serve_http(args.host, args.port, reuse_port=bool(args.reuse_port))
    grpc_server = None
    if args.grpc_port is not None:
        from router.grpc_gateway import start_grpc_gateway

        grpc_server, grpc_port = await start_grpc_gateway(router.gateway, args.host, args.grpc_port)
        print(f"GRPC {grpc_port}", flush=True)
    gc.collect()
    gc.freeze()  # the start-up heap (tokenizer, protobuf, gRPC) never becomes garbage: keep it out of GC passes
    print(f"READY {port}", flush=True)
    stop = stop_on_signals()
    await stop.wait()
    if grpc_server is not None:
        await grpc_server.stop(1.0)
    await router.close()
    return 0


def _child_cmd(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "router.serve", "--model", args.model, "--workers", args.workers, "--host",
           args.host, "--port", str(port), "--processes", "1", "--reuse-port", "--min-uncached-tokens",
           str(args.min_uncached_tokens), "--block-size", str(args.block_size), "--worker-dead-after",
           str(args.worker_dead_after), "--log-level", args.log_level]
    if args.redis:
        cmd += ["--redis", args.redis]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if args.grpc_port is not None:
        cmd += ["--grpc-port", str(args.grpc_port)]  # gRPC binds with SO_REUSEPORT too
    return cmd


def _supervise(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children: list[ReadyProcess] = []
    try:
        first = ReadyProcess.start("router-0", _child_cmd(args, args.port))
        children.append(first)
        for i in range(1, args.processes):
            children.append(ReadyProcess.start(f"router-{i}", _child_cmd(args, first.port)))
        print(f"READY {first.port}", flush=True)
        while not stop.wait(0.2):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"error: {dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].tail()}",
                      file=sys.stderr)
                return 1
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for c in children:
            c.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_router_args(p)
    args = p.parse_args(argv)
    if args.processes < 1:
        print(f"error: --processes must be >= 1, got {args.processes}", file=sys.stderr)
        return 2
    if not args.workers and not args.redis:
        print("error: give --workers or --redis", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.processes > 1:
        return _supervise(args)
    t0 = time.monotonic()
    rc = asyncio.run(_serve_one(args))
    log.info("router stopped after %.1fs", time.monotonic() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
