"""The gateway's HTTP/1.1 server (router/http.py), on loopback, spoken to through raw sockets so that every byte
on the wire is checked: keep-alive and pipelining, 100-continue, size limits, malformed requests, chunked and
close-delimited streams, a client that disconnects mid-stream (its handler is cancelled), handler errors, idle
connections and shutdown."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from router.http import HTTPServer, Request, Response, StreamResponse


class App:
    """Handlers: /echo answers the body; /stream streams N pieces; /slow-stream streams until cancelled; /boom fails."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.seen: list[tuple[str, str, bytes]] = []

    async def handle(self, req: Request) -> Response | StreamResponse:
        self.seen.append((req.method, req.path, req.body))
        if req.path == "/echo":
            return Response(req.body, headers={"X-Query": req.query})
        if req.path == "/stream":
            resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)
            for i in range(3):
                await resp.write(f"data: {i}\n\n".encode())
            await resp.write_eof()
            return resp
        if req.path == "/slow-stream":
            resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)
            try:
                while True:
                    await resp.write(b"data: tick\n\n")
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if req.path == "/boom":
            raise RuntimeError("handler bug")
        if req.path == "/sleep":
            await asyncio.sleep(float(req.query or "0.3"))
            return Response(b"late")
        return Response(b"no", status=404)


class Server:
    def __init__(self, **kw: Any) -> None:
        self.app = App()
        self.loop = asyncio.new_event_loop()
        self.server = HTTPServer(self.app.handle, **kw)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.server.start("127.0.0.1", 0), self.loop).result(10)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        return s

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture()
def srv() -> Iterator[Server]:
    s = Server(max_body=1024)
    yield s
    s.stop()


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response off ``sock`` (``buf`` keeps bytes already read past it): status, headers, decoded body."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed before a full head: {bytes(buf)!r}")
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    buf[:] = rest
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            buf += sock.recv(65536)
        body = bytes(buf[:n])
        del buf[:n]
        return status, headers, body
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in buf:
                buf += sock.recv(65536)
            size_line, _, _ = bytes(buf).partition(b"\r\n")
            size = int(size_line, 16)
            need = len(size_line) + 2 + size + 2
            while len(buf) < need:
                buf += sock.recv(65536)
            body += bytes(buf[len(size_line) + 2:len(size_line) + 2 + size])
            del buf[:need]
            if size == 0:
                return status, headers, body
    body = bytes(buf)  # close-delimited
    while data := sock.recv(65536):
        body += data
    buf.clear()
    return status, headers, body


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_keep_alive_and_pipelined_requests_are_answered_in_order(srv: Server) -> None:
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(post("/echo?a=1", b"first"))
        assert read_response(s, buf) == (200, {"content-type": "application/json", "content-length": "5",
                                               "x-query": "a=1"}, b"first")
        s.sendall(post("/echo", b"two") + post("/echo", b"three") + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [read_response(s, buf)[2] for _ in range(3)] == [b"two", b"three", b""]
    assert [m for m, _, _ in srv.app.seen] == ["POST", "POST", "POST", "GET"]


def test_expect_100_continue_gets_an_interim_response(srv: Server) -> None:
    with srv.connect() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"body")
        buf = bytearray()
        assert read_response(s, buf)[2] == b"body"


@pytest.mark.parametrize(("request_bytes", "status"), [
    (post("/echo", b"x" * 2000), 413),  # declared length over max_body
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"y" * 1024 + b"\r\n"
     + b"400\r\n" + b"y" * 1024 + b"\r\n0\r\n\r\n", 413),  # chunked body growing over it
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"z" * (70 << 10) + b"\r\n\r\n", 431),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
], ids=["content-length", "chunked", "headers", "garbage"])
def test_oversized_and_malformed_requests_are_refused_and_the_connection_closed(
        srv: Server, request_bytes: bytes, status: int) -> None:
    with srv.connect() as s:
        s.sendall(request_bytes)
        buf = bytearray()
        got, headers, body = read_response(s, buf)
        assert got == status and headers["connection"] == "close" and b'"error"' in body
        assert s.recv(100) == b""  # closed
    assert not srv.app.seen


def test_a_malformed_request_pipelined_behind_a_slow_one_is_refused_after_it(srv: Server) -> None:
    """The slow request's answer comes first and whole; then the 400 for the garbage; then the connection closes."""
    with srv.connect() as s:
        s.sendall(b"GET /sleep?0.2 HTTP/1.1\r\nHost: x\r\n\r\n" + b"GARBAGE \x00\x01 NOT HTTP\r\n\r\n")
        buf = bytearray()
        assert read_response(s, buf)[:3:2] == (200, b"late")
        status, headers, body = read_response(s, buf)
        assert status == 400 and headers["connection"] == "close" and b"malformed" in body
        assert s.recv(100) == b""


def test_streams_are_chunked_and_keep_the_connection(srv: Server) -> None:
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(post("/stream", b""))
        status, headers, body = read_response(s, buf)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        s.sendall(post("/echo", b"after"))
        assert read_response(s, buf)[2] == b"after"


def test_http_1_0_gets_a_close_delimited_stream_and_connection_close_is_honoured(srv: Server) -> None:
    with srv.connect() as s:
        s.sendall(post("/stream", b"", version="1.0"))
        status, headers, body = read_response(s, bytearray())
        assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    with srv.connect() as s:
        s.sendall(post("/echo", b"bye", extra="Connection: close\r\n"))
        buf = bytearray()
        assert read_response(s, buf)[1]["connection"] == "close"
        assert s.recv(100) == b""


def test_a_client_that_disconnects_mid_stream_cancels_its_handler(srv: Server) -> None:
    s = srv.connect()
    s.sendall(post("/slow-stream", b""))
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.close()
    assert srv.app.cancelled.wait(5), "the handler kept streaming to a closed connection"


def test_a_failing_handler_answers_500_and_the_connection_stays_usable(srv: Server) -> None:
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(post("/boom", b""))
        status, _, body = read_response(s, buf)
        assert status == 500 and b"internal error" in body
        s.sendall(post("/echo", b"still here"))
        assert read_response(s, buf)[2] == b"still here"


def test_idle_keep_alive_connections_are_closed() -> None:
    srv = Server(keepalive_s=0.2, sweep_s=0.05)
    try:
        with srv.connect() as s:
            s.sendall(post("/echo", b"hi"))
            assert read_response(s, bytearray())[2] == b"hi"
            t0 = time.monotonic()
            assert s.recv(100) == b""
            assert time.monotonic() - t0 < 3.0
    finally:
        srv.stop()


def test_stop_lets_a_request_in_progress_finish() -> None:
    srv = Server()
    with srv.connect() as s:
        s.sendall(b"GET /sleep?0.2 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.05)
        srv.stop()  # grace 0.5 s
        assert read_response(s, bytearray())[2] == b"late"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()


class ExpressApp:
    """An express lane: /x-now answers at once, /x-later from a timer, /x-task in a task, /x-hold never (it records
    its cancellation); everything else is handed back to the coroutine handler (App.handle)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.cancelled = threading.Event()
        self.task_cancelled = threading.Event()

    def express(self, batch: list[Request]) -> None:
        self.batches.append([r.path for r in batch])
        loop = asyncio.get_running_loop()
        for req in batch:
            if req.path == "/x-now":
                req.answer(Response(b"now:" + req.body))
            elif req.path == "/x-later":
                loop.call_later(0.05, req.answer, Response(b"later:" + req.body))
            elif req.path == "/x-task":
                req.continue_in(self._task(req))
            elif req.path == "/x-hold":
                req.on_cancel = self.cancelled.set
            else:
                req.state = "seen by express"
                req.fallback()

    async def _task(self, req: Request) -> Response:
        try:
            await asyncio.sleep(float(req.query or "0.05"))
        except asyncio.CancelledError:
            self.task_cancelled.set()
            raise
        return Response(b"task:" + req.body)


@pytest.fixture()
def xsrv() -> Iterator[tuple[Server, ExpressApp]]:
    app = ExpressApp()
    s = Server(max_body=1024, express=app.express)
    yield s, app
    s.stop()


def test_express_requests_are_answered_from_callbacks_and_tasks_in_connection_order(
        xsrv: tuple[Server, ExpressApp]) -> None:
    """A connection's first request takes the express lane; requests pipelined behind it wait for its answer and
    then go the coroutine way, in order; a request handed back reaches the handler with what express saw."""
    srv, app = xsrv
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(post("/x-later", b"1") + post("/x-now", b"2") + post("/echo", b"3"))
        assert [read_response(s, buf)[2] for _ in range(3)] == [b"later:1", b"no", b"3"]
        s.sendall(post("/x-task", b"4"))
        assert read_response(s, buf)[2] == b"task:4"
        s.sendall(post("/echo", b"5"))
        assert read_response(s, buf)[2] == b"5"
        s.sendall(post("/x-now", b"6", extra="Connection: close\r\n"))
        status, headers, body = read_response(s, buf)
        assert (status, body, headers.get("content-length")) == (200, b"now:6", "5")
        assert s.recv(10) == b""  # closed after the answer, as asked
    # /x-now pipelined behind /x-later went to the coroutine handler (App.handle answers it 404 "no").
    assert [p for b in app.batches for p in b] == ["/x-later", "/x-task", "/echo", "/x-now"]
    assert [p for _, p, _ in srv.app.seen] == ["/x-now", "/echo", "/echo"]


def test_a_batch_holds_every_connection_that_sent_in_one_loop_iteration(xsrv: tuple[Server, ExpressApp]) -> None:
    srv, app = xsrv
    socks = [srv.connect() for _ in range(6)]
    try:
        # Every connection accepted first: one the loop accepts only after its nap has its bytes read an iteration
        # later, which is not what this test is about.
        deadline = time.monotonic() + 5
        while len(srv.server.connections) < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
        srv.loop.call_soon_threadsafe(time.sleep, 0.2)  # the loop is busy while all six requests arrive
        for i, s in enumerate(socks):
            s.sendall(post("/x-now", str(i).encode()))
        bufs = [bytearray() for _ in socks]
        assert [read_response(s, b)[2] for s, b in zip(socks, bufs, strict=True)] == [
            f"now:{i}".encode() for i in range(6)]
        assert max(len(b) for b in app.batches) == 6
    finally:
        for s in socks:
            s.close()


def test_a_client_gone_cancels_its_express_request_and_a_refusal_waits_for_the_answer(
        xsrv: tuple[Server, ExpressApp]) -> None:
    srv, app = xsrv
    with srv.connect() as s:
        s.sendall(post("/x-hold", b""))
        time.sleep(0.1)
    assert app.cancelled.wait(5), "on_cancel was not called"
    with srv.connect() as s:
        s.sendall(post("/x-task?5", b""))
        time.sleep(0.1)
    assert app.task_cancelled.wait(5), "the express task was not cancelled"
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(post("/x-later", b"a") + b"BAD REQUEST LINE\r\n\r\n")
        assert read_response(s, buf)[::2] == (200, b"later:a")  # the answer first, whole
        status, _, body = read_response(s, buf)
        assert status == 400 and b"malformed" in body
