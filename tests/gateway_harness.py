"""What the gateway tests share: a router running in-process on its own event-loop thread (its gateway served by
granian on loopback), real ``tandem worker`` processes in front of it, and the workers' block accounting read
through their ``Load`` RPC."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from proto.tandem.v1 import worker_pb2 as pb
from router.handoff import WorkerClient
from router.server import Router, RouterConfig, build_router
from worker.launcher import WorkerProcess

WORKER_FLAGS = ["--num-kv-blocks", "512", "--threads", "1"]


class RouterThread:
    """``build_router(cfg)`` on a loop of its own; ``url`` serves the gateway (and ``metrics_url`` /metrics when
    ``metrics_port`` is set)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.router: Router | None = None
        self.port = self.metrics_port = 0
        self.error: BaseException | None = None
        ready = threading.Event()

        async def main() -> None:
            try:
                self.router = await build_router(cfg)
                self.port = await self.router.serve_http("127.0.0.1", 0)
                if cfg.metrics_port is not None:
                    self.metrics_port = await self.router.serve_metrics("127.0.0.1", cfg.metrics_port)
            except BaseException as e:
                self.error = e
            ready.set()

        self.thread = threading.Thread(target=self._run, args=(main,), daemon=True)
        self.thread.start()
        if not ready.wait(120):
            raise TimeoutError("the router did not start within 120 s")
        if self.error is not None:
            raise self.error
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"

    def _run(self, main: Callable[[], Any]) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(main())
        self.loop.run_forever()

    def call(self, fn: Callable[[Router], Any]) -> Any:
        async def run() -> Any:
            assert self.router is not None
            return fn(self.router)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def call_async(self, fn: Callable[[Router], Any]) -> Any:
        """Await ``fn(router)`` on the router's loop."""
        async def run() -> Any:
            assert self.router is not None
            return await fn(self.router)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        async def down() -> None:
            if self.router is not None:
                await self.router.close()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def loads(workers: list[WorkerProcess]) -> list[pb.LoadResponse]:
    out = []
    for w in workers:
        client = WorkerClient.connect(w.address)
        try:
            out.append(client.stub.Load(pb.LoadRequest(), timeout=10))
        finally:
            client.close()
    return out


def wait_idle(workers: list[WorkerProcess], timeout_s: float = 30.0) -> list[pb.LoadResponse]:
    """The workers' loads once nothing runs, waits or holds a block (or the last seen after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ls = loads(workers)
        if all(ld.running == 0 and ld.waiting == 0 and ld.waiting_for_kv == 0 and ld.used_blocks == 0 for ld in ls):
            return ls
        if time.monotonic() > deadline:
            return ls
        time.sleep(0.1)


def routed_worker(header: str) -> str:
    """The decode worker of the first plan in an ``x-tandem-route`` header."""
    return header.split("w=")[-1].split(";")[0] if "decode[" not in header else \
        header.split("decode[")[1].split("w=")[1].split(";")[0]
