"""The gateway as a plain ASGI application, and the request/response types its endpoints speak.

Why plain ASGI and no framework: the gateway has five routes, a JSON body each way and one SSE stream; Starlette or
FastAPI would add a router, middleware stack and request objects per request for nothing the gateway uses, while
the ASGI contract alone (``scope``, ``receive``, ``send``) is all a maintained server needs from it. The server
itself (granian, ``router/http_server.py``) owns every byte of HTTP: parsing, keep-alive, pipelining, chunked
encoding, header and idle timeouts. This module owns what HTTP leaves to the application:

- **the body**: ``Content-Length`` above ``max_body_bytes`` is refused with 413 before a byte of it is read; a
  chunked body is counted as it arrives (413 once it passes the limit); the whole body must arrive within
  ``body_read_timeout_s`` (408 otherwise);
- **isolation**: each request runs in its own ASGI call. An unexpected exception answers that request only: a
  500 whose body and ``x-request-id`` header carry a request id that is also logged with the traceback; the
  handler's own ``finally`` blocks (the dispatcher's) abort the request on every worker it reached;
- **disconnects**: for a request that generates and is still running after ``WATCH_AFTER_S``, a watcher task
  reads ``http.disconnect`` and cancels the handler, which aborts the request on the workers;
- **the head**: a request target longer than ``max_url_bytes`` gets 414 and a header block larger than
  ``max_header_bytes`` gets 431, here, so they are counted like every other response. granian's own read buffer is
  set to ``HEAD_BACKSTOP`` times the header limit: only a head past that is refused by granian itself (hyper), before
  the app, and that one is not counted (router/metrics.py says why);
- **metrics**: every response, from the handler or refused here, is counted by endpoint and status code.

Request lifecycle: ASGI call → body read (limits) → ``Request`` → handler (gateway) → ``Response`` sent whole, or a
``StreamResponse`` written by the handler (``prepare``, ``write``*, ``write_eof``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

log = logging.getLogger(__name__)

WATCH_AFTER_S = 0.05
# granian's HTTP/1 read buffer is this many times ``HTTPConfig.max_header_bytes``: the app's 414/431 (counted) fire
# first; hyper's check against its growing buffer is approximate (80 kB passed at a 64 kB buffer), so the backstop
# sits well above the app's limits.
HEAD_BACKSTOP = 4
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(slots=True, frozen=True)
class HTTPConfig:
    """The HTTP edge's limits. ``header_read_timeout_s`` is granian's (hyper's) header-read timer: it runs whenever
    a connection waits for a request head, so it also closes an idle keep-alive connection and a slowloris client
    (one header line every few seconds); granian takes 1 ms to 60 s."""

    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 30.0
    keep_alive: bool = True
    max_body_bytes: int = 16 << 20
    max_url_bytes: int = 8 << 10  # path + query; longer: 414 (vLLM/uvicorn's h11 default is 64 kB for the head)
    max_header_bytes: int = 64 << 10  # names + values of every header; larger: 431
    backlog: int = 1024

    def __post_init__(self) -> None:
        if not 0.001 <= self.header_read_timeout_s <= 60.0:
            raise ValueError(f"header_read_timeout_s must be in [0.001, 60], got {self.header_read_timeout_s}")
        if self.body_read_timeout_s <= 0:
            raise ValueError(f"body_read_timeout_s must be > 0, got {self.body_read_timeout_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_header_bytes < 8192:
            raise ValueError(f"max_header_bytes must be >= 8192, got {self.max_header_bytes}")
        if not 256 <= self.max_url_bytes <= self.max_header_bytes:
            raise ValueError(f"max_url_bytes must be in [256, max_header_bytes], got {self.max_url_bytes}")
        if self.backlog < 128:
            raise ValueError(f"backlog must be >= 128, got {self.backlog}")


class Request:
    __slots__ = ("body", "done", "explain", "gone", "headers", "method", "path", "query", "request_id", "send")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
                 request_id: str = "", send: ASGISend | None = None) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # names lower-cased; a repeated header keeps its last value
        self.body = body
        self.request_id = request_id
        self.send = send  # where a StreamResponse for this request is written
        self.explain = False  # the caller may see routing explanations (set by the gateway's auth)
        self.gone = False  # the client disconnected
        self.done = False  # the response is complete


class Response:
    """A whole response, sent with its ``Content-Length``."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(self, body: bytes = b"", status: int = 200, headers: dict[str, str] | None = None,
                 content_type: str = "application/json") -> None:
        self.body = body
        self.status = status
        self.headers = headers
        self.content_type = content_type


class StreamResponse:
    """A response written piece by piece by its handler: ``prepare`` (sends the head), ``write``*, ``write_eof``."""

    __slots__ = ("_eof", "_request", "_send", "headers", "status")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self._send: ASGISend | None = None
        self._request: Request | None = None
        self._eof = False

    @property
    def prepared(self) -> bool:
        return self._send is not None

    async def prepare(self, request: Request) -> None:
        if self._send is not None:
            return
        if request.send is None:
            raise RuntimeError("this request has no connection to stream to")
        self._send = request.send
        self._request = request
        await request.send({"type": "http.response.start", "status": self.status, "headers": _headers(
            self.headers, None)})

    async def write(self, data: bytes) -> None:
        if self._send is None or self._eof:
            raise RuntimeError("write before prepare or after write_eof")
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def write_eof(self) -> None:
        if self._send is not None and not self._eof:
            self._eof = True
            if self._request is not None:
                self._request.done = True
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
Count = Callable[[str, int], None]  # (path, status) of each response


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(status: int, message: str, request_id: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    err: dict[str, Any] = {"message": message, "type": kind, "param": None, "code": None}
    if request_id:
        err["request_id"] = request_id
    return orjson.dumps({"error": err})


def _headers(headers: dict[str, str] | None, content_type: str | None) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", content_type.encode())] if content_type else []
    if headers:
        out.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    return out


class ASGIApp:
    """``handler`` answers every request; ``watch`` names the paths whose handler generates (a disconnect cancels
    it); ``count`` is told each response's path and status; ``on_startup``/``on_shutdown`` run in the ASGI
    lifespan (the server's worker process builds its router there)."""

    def __init__(self, handler: Handler, config: HTTPConfig, count: Count, watch: frozenset[str] = frozenset(),
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None) -> None:
        self.handler = handler
        self.config = config
        self.count = count
        self.watch = watch
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: ASGIReceive, send: ASGISend) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    if self.on_startup is not None:
                        await self.on_startup()
                except Exception as e:
                    log.exception("router start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                with contextlib.suppress(Exception):
                    if self.on_shutdown is not None:
                        await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_head(scope)
            body = await self._read_body(headers, receive)
        except _Refused as e:
            await self._send_whole(send, path, Response(error_body(e.status, e.message), status=e.status,
                                                        headers={"connection": "close"}))
            return
        query = scope.get("query_string", b"").decode("latin-1")
        request = Request(scope["method"], path, query, headers, body, "", send)
        watcher: list[asyncio.Task[None]] = []
        me = asyncio.current_task()
        # The disconnect watcher starts only for a request still running after WATCH_AFTER_S: most answers are
        # sent sooner, and a task per request costs as much as the rest of this function.
        timer = (asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, lambda: watcher.append(asyncio.ensure_future(self._watch(receive, request, me))))
            if path in self.watch and me is not None else None)
        try:
            resp = await self.handler(request)
        except asyncio.CancelledError:
            if not request.gone:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.count(path, 499)  # the client closed the connection (nginx's code); its work was aborted
            return
        except Exception:
            request.request_id = f"req-{os.urandom(8).hex()}"
            log.exception("request %s %s %s failed", request.request_id, scope["method"], path)
            if request.gone:
                return
            await self._internal_error(send, request, path)
            return
        finally:
            if timer is not None:
                timer.cancel()
            for w in watcher:
                w.cancel()
        if isinstance(resp, StreamResponse):
            self.count(path, resp.status)
            if not resp._eof:
                with contextlib.suppress(Exception):
                    await resp.write_eof()
            return
        await self._send_whole(send, path, resp)

    async def _internal_error(self, send: ASGISend, request: Request, path: str) -> None:
        rid = request.request_id
        msg = f"internal error; request id {rid}"
        if request.done:
            return
        # A stream whose head went out ends with an SSE error event; otherwise a whole 500.
        try:
            await self._send_whole(send, path, Response(error_body(500, msg, rid), status=500,
                                                        headers={"x-request-id": rid}))
        except Exception:
            self.count(path, 500)
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + error_body(500, msg, rid) + b"\n\n"})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_whole(self, send: ASGISend, path: str, resp: Response) -> None:
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": _headers(resp.headers, resp.content_type)})
        await send({"type": "http.response.body", "body": resp.body})
        self.count(path, resp.status)

    def _check_head(self, scope: dict[str, Any]) -> None:
        cfg = self.config
        target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string", b""))
        if target > cfg.max_url_bytes:
            raise _Refused(414, f"request target longer than {cfg.max_url_bytes} bytes")
        size = sum(len(k) + len(v) for k, v in scope["headers"])
        if size > cfg.max_header_bytes:
            raise _Refused(431, f"request headers larger than {cfg.max_header_bytes} bytes")

    async def _read_body(self, headers: dict[str, str], receive: ASGIReceive) -> bytes:
        limit = self.config.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _Refused(413, f"request body larger than {limit} bytes")
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.config.body_read_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise _Refused(400, "the client went away before its body was read")
                    chunk = msg.get("body", b"")
                    if chunk:
                        size += len(chunk)
                        if size > limit:
                            raise _Refused(413, f"request body larger than {limit} bytes")
                        parts.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            raise _Refused(408, f"request body not received within {self.config.body_read_timeout_s:g}s") from None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _watch(self, receive: ASGIReceive, request: Request, handler: asyncio.Task[Any]) -> None:
        """Wait for the client's disconnect; then cancel the handler (its request is aborted on the workers)."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
        if request.done:
            return
        request.gone = True
        handler.cancel()
