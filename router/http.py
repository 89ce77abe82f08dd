"""The gateway's HTTP/1.1 server: an asyncio protocol on httptools (llhttp, the parser Node.js uses).

aiohttp spent ~80-100 µs of CPU per request here (its request and response objects, middleware chain, header
multidicts and writer); this server does what the OpenAI gateway needs in a fraction of that:

- keep-alive and pipelined requests (answered in order, one at a time per connection), HTTP/1.0 and
  ``Connection: close``, ``Expect: 100-continue``;
- bodies up to ``max_body`` bytes (413 beyond), headers up to ``MAX_HEADER_BYTES`` (431 beyond), malformed requests
  answered 400 and the connection closed;
- whole responses with ``Content-Length``; streamed ones (SSE) with chunked transfer encoding, or close-delimited
  for an HTTP/1.0 client, with the transport's write buffer bounded (a slow reader pauses the writer);
- a client that disconnects cancels its request's handler task, so the request is aborted on every worker;
- idle keep-alive connections are closed after ``keepalive_s``.

The handler is one coroutine ``handle(request) -> Response | StreamResponse``; a ``StreamResponse`` is written to
the connection by the handler itself (``prepare``, ``write``, ``write_eof``), as in aiohttp.

**Express lane.** A server may also have an ``express`` callable, which takes the requests that arrived in one
event-loop iteration, each the only request of its connection in progress, as one batch, with no task per request.
For each it either answers later from a callback (``Request.answer``), or continues it in a task of its own
(``Request.continue_in``), or hands it back to the coroutine handler (``Request.fallback``). A request that is
pipelined behind another goes the coroutine way. A client that disconnects while its express request is in
progress gets its ``on_cancel`` called (or its task cancelled), as a handler task would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from http import HTTPStatus
from typing import Any

import httptools
import orjson

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_INTERNAL = b'{"error":{"message":"internal error","type":"server_error","param":null,"code":null}}'
_LINGER_S = 2.0


class Request:
    __slots__ = ("body", "conn", "headers", "http_version", "keep_alive", "method", "on_cancel", "path", "query",
                 "state")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
                 http_version: str, keep_alive: bool, conn: _Connection | None = None) -> None:
        self.conn = conn  # where a StreamResponse for this request is written
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # names lower-cased; a repeated header keeps its last value
        self.body = body
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.state: Any = None  # what an express handler learnt of the request before handing it back
        self.on_cancel: Callable[[], None] | None = None  # an express request's abort, if the client goes away

    async def read(self) -> bytes:
        return self.body

    # ---- the express lane's side (see the module docstring) ---------------------------------------------------

    def answer(self, resp: Response) -> None:
        """Send the whole answer of an express request (a no-op if its client has gone)."""
        conn = self.conn
        if conn is not None:
            conn.express_done(self, resp)

    def fallback(self) -> None:
        """Hand an express request to the coroutine handler instead."""
        conn = self.conn
        if conn is not None:
            conn.express_fallback(self)

    def continue_in(self, coro: Coroutine[Any, Any, Response]) -> None:
        """Finish an express request in a task running ``coro`` (cancelled if the client goes away), which
        returns the answer."""
        conn = self.conn
        if conn is None:
            coro.close()
            return
        conn.express_continue(self, coro)


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

    __slots__ = ("_conn", "_eof", "_prepared", "headers", "status")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self._conn: _Connection | None = None
        self._prepared = False
        self._eof = False

    async def prepare(self, request: Request) -> None:
        conn = request.conn
        if conn is None:
            raise RuntimeError("this request has no connection to stream to")
        if not self._prepared:
            self._prepared = True
            self._conn = conn
            conn.send_stream_head(self, request)

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or self._eof:
            raise RuntimeError("write before prepare or after write_eof")
        await conn.send_stream_data(data)

    async def write_eof(self) -> None:
        if self._conn is not None and not self._eof:
            self._eof = True
            self._conn.send_stream_eof()


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
Express = Callable[[list[Request]], None]


class _Connection(asyncio.Protocol):
    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.express: Request | None = None  # this connection's express request in progress
        self.express_task: asyncio.Task[None] | None = None  # ... when it continues in a task
        self.closing = False
        self.last_s = time.monotonic()
        self._drain: asyncio.Future[None] | None = None
        self._paused_reading = False
        # the request being parsed
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._streaming = False  # the current request's StreamResponse has sent its head
        self._discarding = False  # refused: reading and dropping what the client still sends, then closing
        self._deferred: tuple[int, str] | None = None  # a refusal to send once the requests before it are answered
        self._chunked_out = False
        self._stream_keep_alive = False
        self._head = b""  # a stream's head, not yet sent

    # ---- asyncio.Protocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: its request is aborted on the workers
        req = self.express
        if req is not None:
            self.express = None
            req.conn = None
            if self.express_task is not None:
                self.express_task.cancel()
            elif req.on_cancel is not None:
                try:
                    req.on_cancel()
                except Exception:
                    log.exception("cancelling an express request failed")
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)  # the writer wakes and finds the connection closing
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self.last_s = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:  # httptools wraps what a callback raises (a _Refused) in one
            cause = e.__context__ if isinstance(e.__context__, _Refused) else None
            if cause is not None:
                self._refuse(cause.status, cause.message)
            else:
                self._refuse(400, f"malformed HTTP request: {e}")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed or taken, then close; after the answers to the requests before it
        on this connection (pipelined), never in the middle of one."""
        self._discarding = True
        if self.busy is False:
            self._fail(status, message)
        else:
            self._deferred = (status, message)

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ---- httptools callbacks ---------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Refused(414, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Refused(431, "request headers too large")
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body:
            raise _Refused(413, f"request body larger than {self.server.max_body} bytes")
        if self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self.server.max_body:
            raise _Refused(413, f"request body larger than {self.server.max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        url = self._url.decode("latin-1")
        path, _, query = url.partition("?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(p.get_method().decode("latin-1"), path, query, self._headers, body, p.get_http_version(),
                      p.should_keep_alive(), self)
        server = self.server
        if server.express is not None and self.busy is False:
            self.express = req
            server.enqueue_express(req)
            return
        self.queue.append(req)
        if len(self.queue) > 16 and not self._paused_reading and self.transport is not None:
            self._paused_reading = True  # a client pipelining far ahead: stop reading until we catch up
            self.transport.pause_reading()
        if self.task is None and self.express is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    @property
    def busy(self) -> bool:
        """A request of this connection is in progress or queued."""
        return self.task is not None or self.express is not None or bool(self.queue)

    # ---- the express lane ------------------------------------------------------------------------------------

    def express_done(self, req: Request, resp: Response) -> None:
        if self.express is not req:
            return
        self.express = None
        self.express_task = None
        req.conn = None
        self._send(resp, req)
        if not req.keep_alive:
            self._close()
            return
        self.last_s = time.monotonic()
        self._next()

    def express_fallback(self, req: Request) -> None:
        if self.express is not req:
            return
        self.express = None
        self.queue.appendleft(req)
        self._next()

    def express_continue(self, req: Request, coro: Coroutine[Any, Any, Response]) -> None:
        if self.express is not req or self.express_task is not None:
            coro.close()
            return

        async def run() -> None:
            try:
                resp = await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("express request %s %s failed", req.method, req.path)
                resp = Response(_INTERNAL, status=500)
            self.express_done(req, resp)

        self.express_task = asyncio.get_running_loop().create_task(run())

    def _next(self) -> None:
        """After an express request: serve what was pipelined behind it, or send a deferred refusal."""
        if self.closing:
            return
        if self.queue:
            if self.task is None:
                self.task = asyncio.get_running_loop().create_task(self._serve())
        elif self._deferred is not None and self.task is None:
            self._fail(*self._deferred)

    # ---- serving ---------------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closing:
                req = self.queue.popleft()
                if self._paused_reading and len(self.queue) <= 4 and self.transport is not None:
                    self._paused_reading = False
                    self.transport.resume_reading()
                self._streaming = False
                try:
                    resp = await self.server.handler(req)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("handler failed on %s %s", req.method, req.path)
                    if self._streaming:  # a response is half sent: only closing the connection tells the client
                        self._close()
                        return
                    resp = Response(_INTERNAL, status=500)
                req.conn = None
                if isinstance(resp, Response):
                    self._send(resp, req)
                elif not resp._eof:
                    if not resp._prepared:  # a stream its handler never started: nothing valid was sent
                        self._close()
                        return
                    await resp.write_eof()
                if not (req.keep_alive and (isinstance(resp, Response) or self._stream_keep_alive)):
                    self._close()
                    return
                self.last_s = time.monotonic()
        except (ConnectionError, asyncio.CancelledError):  # the client went away mid-request
            self._close()
        finally:
            self.task = None
        if self._deferred is not None and not self.closing:
            self._fail(*self._deferred)

    def _send(self, resp: Response, req: Request) -> None:
        if self.transport is None or self.closing:
            return
        head = [b"HTTP/1.1 ", str(resp.status).encode(), b" ", _REASONS.get(resp.status, b""), b"\r\n",
                b"Content-Type: ", resp.content_type.encode(), b"\r\nContent-Length: ", str(len(resp.body)).encode(),
                b"\r\n"]
        if not req.keep_alive:
            head.append(b"Connection: close\r\n")
        if resp.headers:
            for k, v in resp.headers.items():
                head += (k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n")
        head.append(b"\r\n")
        if req.method != "HEAD":
            head.append(resp.body)
        self.transport.write(b"".join(head))

    def send_stream_head(self, resp: StreamResponse, req: Request) -> None:
        if self.transport is None or self.closing:
            raise ConnectionResetError("client disconnected")
        self._streaming = True
        self._chunked_out = req.http_version != "1.0"
        self._stream_keep_alive = self._chunked_out and req.keep_alive
        head = [b"HTTP/1.1 ", str(resp.status).encode(), b" ", _REASONS.get(resp.status, b""), b"\r\n"]
        for k, v in resp.headers.items():
            head += (k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n")
        head.append(b"Transfer-Encoding: chunked\r\n" if self._chunked_out else b"Connection: close\r\n")
        if self._chunked_out and not self._stream_keep_alive:
            head.append(b"Connection: close\r\n")
        head.append(b"\r\n")
        # Held until the first piece of the body (or the end): head and first event leave in one segment, so a
        # client does not wake for a head and then again for the event it waits for.
        self._head = b"".join(head)

    async def send_stream_data(self, data: bytes) -> None:
        if self.transport is None or self.closing:
            raise ConnectionResetError("client disconnected")
        if not data:
            return
        if self._chunked_out:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head:
            data = self._head + data
            self._head = b""
        self.transport.write(data)
        if self._drain is not None and not self._drain.done():
            await self._drain  # the client reads slower than we write: wait for the buffer to empty
            if self.closing:
                raise ConnectionResetError("client disconnected")

    def send_stream_eof(self) -> None:
        if self.transport is not None and not self.closing:
            tail = b"0\r\n\r\n" if self._chunked_out else b""
            if self._head or tail:
                self.transport.write(self._head + tail)
            self._head = b""

    def _fail(self, status: int, message: str) -> None:
        """Answer ``status`` and close, lingering: closing with unread bytes (the rest of an oversized body) would
        reset the connection, and the client could lose the answer; so what still comes is read and dropped, the
        write side is shut, and the socket closes when the client does or ``_LINGER_S`` later."""
        t = self.transport
        if t is None or self.closing:
            return
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}})
        t.write(b"HTTP/1.1 %d %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%b" % (status, _REASONS.get(status, b""), len(body), body))
        self.closing = True
        self._discarding = True
        if t.can_write_eof():
            t.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, t.close)

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HTTPServer:
    def __init__(self, handler: Handler, max_body: int = 8 << 20, keepalive_s: float = 75.0,
                 sweep_s: float = 5.0, express: Express | None = None) -> None:
        self.handler = handler
        self.express = express
        self._express_batch: list[Request] = []
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.sweep_s = sweep_s  # how often idle connections are looked for
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False, backlog: int = 1024) -> int:
        """Listen on ``host:port`` (0: a free port); return the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_port=reuse_port or None,
                                                backlog=backlog)
        self._sweeper = loop.create_task(self._sweep())
        port_bound: int = self._server.sockets[0].getsockname()[1]
        return port_bound

    def enqueue_express(self, req: Request) -> None:
        """Add ``req`` to this loop iteration's express batch (run once the iteration's reads are all in)."""
        if not self._express_batch:
            asyncio.get_running_loop().call_soon(self._run_express)
        self._express_batch.append(req)

    def _run_express(self) -> None:
        batch, self._express_batch = self._express_batch, []
        assert self.express is not None
        try:
            self.express(batch)
        except Exception:
            log.exception("express handler failed on a batch of %d", len(batch))
            for req in batch:
                req.answer(Response(_INTERNAL, status=500))

    async def _sweep(self) -> None:
        """Close keep-alive connections idle for longer than ``keepalive_s`` (none with a request in progress)."""
        while True:
            await asyncio.sleep(self.sweep_s)
            cutoff = time.monotonic() - self.keepalive_s
            for c in [c for c in self.connections if not c.busy and c.last_s < cutoff]:
                c._close()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop listening, let requests in progress finish for up to ``grace_s``, then close every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + grace_s
        while any(c.task is not None or c.express is not None for c in self.connections) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            c._close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
