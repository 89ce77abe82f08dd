"""``python -m router.serve``: a standalone router in front of given workers, in one process or several.

One process: build the router (tokenizer, worker pool, KV index following every worker's event stream), serve the
HTTP gateway on granian's embedded server (router/http_server.py; with ``--grpc-port`` the client gRPC API too,
``proto/tandem/v1/gateway.proto``, announced by a ``GRPC <port>`` line; with ``--metrics-port`` ``/metrics`` on a
port of its own, a ``METRICS <port>`` line), freeze the start-up heap out of the GC's way, print ``READY <port>``,
serve until SIGTERM/SIGINT.

``--processes N`` (> 1): granian's own multi-process server runs N worker processes on the port; each builds a full
router in its ASGI lifespan (``process_app``, its flags passed in ``TANDEM_ROUTER_ARGV``) and follows the same
workers, so each builds the same KV index from the same events. The load each one books is its own; every router
still sees the others' work through the workers' ``Load`` reports. This process prints ``READY <port>`` once every
worker process has built its router.

Run: ``python -m router.serve --model DIR --workers 127.0.0.1:7001,127.0.0.1:7002 --port 8000 --processes 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.asgi import ASGIApp, HTTPConfig
    from router.server import Router, RouterConfig

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
    p.add_argument("--processes", type=int, default=1, help="router processes on the port (granian's workers)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the client gRPC API (tandem.v1.Gateway) here; 0 picks a free port (GRPC line)")
    p.add_argument("--min-uncached-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (hashes must agree)")
    p.add_argument("--worker-dead-after", type=float, default=10.0, metavar="S",
                   help="fail over every request on a worker that answers no probe for S seconds")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; 'admin:KEY' for an "
                   "admin key, which may ask for x-tandem-explain)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="a file of API keys, one per line ('admin:KEY' for an admin key, '#' comments)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics on this port only (0: a free one, printed as METRICS <port>); without it "
                   "/metrics is on the gateway's port, behind the API keys if any")
    p.add_argument("--vllm-metrics", action="store_true",
                   help="also export vllm:* metric names where vLLM has an equivalent, so vLLM dashboards work")
    p.add_argument("--otlp-endpoint", default=None, metavar="HOST:PORT",
                   help="trace every request with OpenTelemetry, exported over OTLP/gRPC to this collector")
    p.add_argument("--header-read-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request head (or next request, when idle) takes longer (<= 60)")
    p.add_argument("--body-read-timeout", type=float, default=30.0, metavar="S", help="408 after this")
    p.add_argument("--no-keep-alive", action="store_true", help="close each connection after one response")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="413 for a larger request body")
    p.add_argument("--max-prompt-bytes", type=int, default=2 << 20, help="413 for a longer prompt (UTF-8 bytes)")
    p.add_argument("--max-requests-per-decode-worker", type=int, default=256,
                   help="admission: requests in flight in this router per decode worker; 429 beyond")
    p.add_argument("--max-requests-per-prefill-worker", type=int, default=256,
                   help="admission: requests in flight in this router per prefill worker; 429 beyond")
    p.add_argument("--retry-after", type=float, default=1.0, metavar="S", help="Retry-After of a 429 or 503")
    p.add_argument("--tool-call-parser", default="hermes", choices=("hermes", "llama3_json", "mistral"),
                   help="how the model writes tool calls, parsed with tool_choice auto")
    p.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                   help="split <think>...</think> into message.reasoning_content")
    from auth.credentials import add_args as add_credential_args

    add_credential_args(p)  # the workers' cluster token and mTLS: --auth-token-file, --tls-cert/--tls-key/--tls-ca


def http_config(args: argparse.Namespace) -> HTTPConfig:
    from router.asgi import HTTPConfig

    return HTTPConfig(header_read_timeout_s=args.header_read_timeout, body_read_timeout_s=args.body_read_timeout,
                      keep_alive=not args.no_keep_alive, max_body_bytes=args.max_body_bytes)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The router these flags describe (ValueError on a bad value)."""
    from auth.credentials import from_args
    from router.admission import AdmissionConfig
    from router.server import RouterConfig

    admission = AdmissionConfig(max_per_decode_worker=args.max_requests_per_decode_worker,
                                max_per_prefill_worker=args.max_requests_per_prefill_worker,
                                retry_after_s=args.retry_after)
    return RouterConfig(model=args.model, workers=tuple(a for a in args.workers.split(",") if a), redis=args.redis,
                        served_model_name=args.served_model_name, min_uncached_tokens=args.min_uncached_tokens,
                        block_size=args.block_size, worker_dead_after_s=args.worker_dead_after,
                        api_keys=tuple(args.api_key), api_key_file=args.api_key_file, http=http_config(args),
                        admission=admission, max_prompt_bytes=args.max_prompt_bytes, metrics_port=args.metrics_port,
                        credentials=from_args(args), tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, vllm_metrics=args.vllm_metrics,
                        otlp_endpoint=args.otlp_endpoint)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, handled by the running loop: how every long-running Tandem process
    (router, ``tandem up``, the bench's fake backends) waits for its end."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_one(args: argparse.Namespace) -> int:
    from router.server import build_router

    router = await build_router(router_config(args))
    port = await router.serve_http(args.host, args.port)
    grpc_server = None
    if args.grpc_port is not None:
        from router.grpc_gateway import start_grpc_gateway

        grpc_server, grpc_port = await start_grpc_gateway(router.gateway, args.host, args.grpc_port)
        print(f"GRPC {grpc_port}", flush=True)
    if args.metrics_port is not None:
        print(f"METRICS {await router.serve_metrics(args.host, args.metrics_port)}", flush=True)
    gc.collect()
    gc.freeze()  # the start-up heap (tokenizer, protobuf, gRPC) never becomes garbage: keep it out of GC passes
    print(f"READY {port}", flush=True)
    stop = stop_on_signals()
    await stop.wait()
    if grpc_server is not None:
        await grpc_server.stop(1.0)
    await router.close()
    return 0


_ARGV_ENV = "TANDEM_ROUTER_ARGV"
_READY_ENV = "TANDEM_ROUTER_READY_DIR"


def child_argv(args: argparse.Namespace, port: int, grpc_port: int | None) -> list[str]:
    """The flags each worker process of ``--processes N`` builds its router from: the parent's, with the ports
    resolved (granian binds by number in each process) and one process each."""
    argv = ["--model", args.model, "--workers", args.workers, "--host", args.host, "--port", str(port),
            "--min-uncached-tokens", str(args.min_uncached_tokens), "--block-size", str(args.block_size),
            "--worker-dead-after", str(args.worker_dead_after), "--log-level", args.log_level,
            "--header-read-timeout", str(args.header_read_timeout), "--body-read-timeout",
            str(args.body_read_timeout), "--max-body-bytes", str(args.max_body_bytes), "--max-prompt-bytes",
            str(args.max_prompt_bytes), "--max-requests-per-decode-worker", str(args.max_requests_per_decode_worker),
            "--max-requests-per-prefill-worker", str(args.max_requests_per_prefill_worker), "--retry-after",
            str(args.retry_after), "--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        argv += ["--reasoning-parser", args.reasoning_parser]
    for key in args.api_key:
        argv += ["--api-key", key]
    for flag, value in (("--redis", args.redis), ("--served-model-name", args.served_model_name),
                        ("--api-key-file", args.api_key_file)):
        if value:
            argv += [flag, value]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]  # gRPC binds with SO_REUSEPORT in each process
    if args.no_keep_alive:
        argv.append("--no-keep-alive")
    if args.vllm_metrics:
        argv.append("--vllm-metrics")
    if args.otlp_endpoint:
        argv += ["--otlp-endpoint", args.otlp_endpoint]
    from auth.credentials import from_args, to_flags

    return argv + to_flags(from_args(args), args.auth_token_file)


class _ProcessRouter:
    """One granian worker process's router, built in the ASGI lifespan."""

    def __init__(self, args: argparse.Namespace, ready_dir: str | None) -> None:
        self.args = args
        self.ready_dir = ready_dir
        self.router: Router | None = None
        self.grpc_server: object | None = None

    async def startup(self) -> None:
        from router.server import build_router

        args = self.args
        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.router = await build_router(router_config(args))
        if args.grpc_port is not None:
            from router.grpc_gateway import start_grpc_gateway

            self.grpc_server, _ = await start_grpc_gateway(self.router.gateway, args.host, args.grpc_port)
        gc.collect()
        gc.freeze()
        if self.ready_dir:
            Path(self.ready_dir, str(os.getpid())).touch()

    async def shutdown(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.stop(1.0)  # type: ignore[attr-defined]
        if self.router is not None:
            await self.router.close()

    async def handle(self, request: object) -> object:
        assert self.router is not None, "a request before the router was built"
        return await self.router.gateway.handle(request)  # type: ignore[arg-type]

    def count(self, path: str, status: int) -> None:
        if self.router is not None:
            self.router.gateway.count(path, status)


def process_app() -> ASGIApp:
    """granian's factory target for ``--processes N``: the gateway app of one worker process."""
    from router.asgi import ASGIApp
    from router.gateway import GENERATE_PATHS

    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(json.loads(os.environ[_ARGV_ENV]))
    holder = _ProcessRouter(args, os.environ.get(_READY_ENV))
    return ASGIApp(holder.handle, http_config(args), holder.count, watch=GENERATE_PATHS,  # type: ignore[arg-type]
                   on_startup=holder.startup, on_shutdown=holder.shutdown)


def _serve_processes(args: argparse.Namespace) -> int:
    from router.http_server import free_port, serve_processes

    if args.metrics_port is not None:
        print("error: --metrics-port needs --processes 1 (each process keeps its own metrics)", file=sys.stderr)
        return 2
    router_config(args)  # flags checked here, before any process starts
    port = args.port or free_port(args.host)
    grpc_port = None if args.grpc_port is None else (args.grpc_port or free_port(args.host))
    ready_dir = tempfile.mkdtemp(prefix="tandem-router-")
    os.environ[_ARGV_ENV] = json.dumps(child_argv(args, port, grpc_port))
    os.environ[_READY_ENV] = ready_dir

    def announce() -> None:
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline:
            if len(os.listdir(ready_dir)) >= args.processes:
                if grpc_port is not None:
                    print(f"GRPC {grpc_port}", flush=True)
                print(f"READY {port}", flush=True)
                return
            time.sleep(0.05)
        print(f"error: {args.processes} router processes not ready within 120 s", file=sys.stderr, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        serve_processes("router.serve:process_app", args.host, port, args.processes, http_config(args))
    finally:
        for name in os.listdir(ready_dir):
            Path(ready_dir, name).unlink(missing_ok=True)
        os.rmdir(ready_dir)
    return 0


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
    try:
        cfg = router_config(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.credentials is not None and cfg.credentials.token is None:
        log.warning("no cluster token (--auth-token-file or $TANDEM_CLUSTER_TOKEN): workers refuse this router's "
                    "Snapshot and Abort%s", ", and it ignores every Redis entry" if args.redis else "")
    if args.processes > 1:
        return _serve_processes(args)
    t0 = time.monotonic()
    rc = asyncio.run(_serve_one(args))
    log.info("router stopped after %.1fs", time.monotonic() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
