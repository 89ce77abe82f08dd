"""The gateway's HTTP server: granian, a maintained Rust HTTP server (hyper) for Python ASGI applications.
It runs the app on asyncio's own loop: the router's session protocol (router/session.py) takes asyncio transports.

Why granian and not uvicorn (vLLM's choice): uvicorn has no header-read timeout (its keep-alive timer only runs
between requests and is reset by every byte), so a slowloris client holds a connection forever unless the
application patches uvicorn's protocol classes. granian's HTTP/1 settings give it through hyper: the header-read
timer runs whenever a connection waits for a request head, so it closes a slowloris client, a silent connection and
an idle keep-alive connection alike. hyper does all the parsing (pipelining, chunked bodies, conflicting
``Content-Length`` / ``Transfer-Encoding``, HTTP/1.0), and the head's size is bounded by its read buffer. The body
limits and the body-read timeout are the ASGI app's (router/asgi.py).

Two ways to run it:

- ``HTTPServer``: granian's embedded server, on the caller's running event loop, in this process (``tandem up``,
  tests, one-process ``python -m router.serve``): the router is built first and the ASGI app closes over it.
- ``serve_processes``: granian's own multi-process server (``--processes N``): granian binds the port in each of
  its N worker processes (``SO_REUSEPORT``, the kernel spreads connections) and runs the app's ASGI lifespan in
  each, where that process builds its own router (router/serve.py). Every router follows the same workers and so
  builds the same KV index.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

from granian.constants import HTTPModes, Interfaces, Loops
from granian.http import HTTP1Settings
from granian.server.embed import Server as EmbeddedServer

from router.asgi import HEAD_BACKSTOP, ASGIApp, HTTPConfig


def free_port(host: str) -> int:
    """A port free on ``host`` now (granian binds by number; port 0 is resolved here first)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def granian_options(config: HTTPConfig) -> dict[str, Any]:
    """The granian settings of an ``HTTPConfig`` (embedded and multi-process servers alike)."""
    return {"http": HTTPModes.http1, "websockets": False, "backlog": config.backlog, "log_enabled": False,
            "http1_settings": HTTP1Settings(header_read_timeout=max(1, round(config.header_read_timeout_s * 1000)),
                                            keep_alive=config.keep_alive,
                                            max_buffer_size=config.max_header_bytes * HEAD_BACKSTOP)}


class HTTPServer:
    """An ASGI app served by granian's embedded server on the running loop."""

    def __init__(self, app: ASGIApp, config: HTTPConfig) -> None:
        self.app = app
        self.config = config
        self.port = 0
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0: a free port) and serve; return the port once it accepts connections."""
        self.port = port or free_port(host)
        # ASGINL: no lifespan (the router is built before the server starts).
        self._server = EmbeddedServer(self.app, address=host, port=self.port, interface=Interfaces.ASGINL,
                                      **granian_options(self.config))
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + 15.0
        while True:
            if self._task.done():
                exc = self._task.exception()
                raise OSError(f"the HTTP server did not start on {host}:{self.port}: {exc}")
            try:
                _, writer = await asyncio.open_connection(host, self.port)
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return self.port
            except OSError:
                if time.monotonic() > deadline:
                    await self.stop()
                    raise OSError(f"the HTTP server did not start on {host}:{self.port} within 15 s") from None
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.stop()
        try:
            await asyncio.wait_for(self._task, 10.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        except Exception:  # a server that failed to start: nothing left to stop
            pass
        self._server = None
        self._task = None


def serve_processes(target: str, host: str, port: int, processes: int, config: HTTPConfig) -> None:
    """Serve the ASGI app made by the factory ``target`` (``module:function``) from ``processes`` granian worker
    processes on ``host:port``, each running the app's lifespan; blocks until SIGINT/SIGTERM (granian's handlers)."""
    from granian import Granian

    Granian(target, address=host, port=port, interface=Interfaces.ASGI, workers=processes, factory=True,
            loop=Loops.asyncio, workers_kill_timeout=10, **granian_options(config)).serve()
