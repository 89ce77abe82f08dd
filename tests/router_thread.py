"""An in-process router for end-to-end tests: its own asyncio loop on a thread, serving HTTP on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from router.server import Router, RouterConfig, build_router


class RouterThread:
    def __init__(self, cfg: RouterConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.router: Router | None = None
        self.port = 0
        self.error: BaseException | None = None
        ready = threading.Event()

        async def main() -> None:
            try:
                self.router = await build_router(cfg)
                self.port = await self.router.serve_http("127.0.0.1", 0)
            except BaseException as e:
                self.error = e
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(main())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(120)
        if self.error is not None:
            raise self.error
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[Router], Any]) -> Any:
        """``fn(router)`` on the router's loop; its result."""
        async def run() -> Any:
            assert self.router is not None
            return fn(self.router)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def stop(self) -> None:
        async def down() -> None:
            assert self.router is not None
            await self.router.close()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
