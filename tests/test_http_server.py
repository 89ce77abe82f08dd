"""The gateway's HTTP edge (router/asgi.py on granian, router/http_server.py), on loopback, spoken to through raw
sockets so that what a hostile or broken client sends is exactly what the server sees: slowloris heads, idle and
silent connections, incomplete requests, conflicting ``Content-Length`` and ``Transfer-Encoding``, HTTP/1.0,
pipelining, body limits and the body-read timeout, a handler that fails (500 with a request id, for that request
only), a client that disconnects mid-stream (its handler is cancelled), and every response counted."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import orjson
import pytest

from router.asgi import ASGIApp, HTTPConfig, Request, Response, StreamResponse
from router.http_server import HTTPServer


class App:
    """Handlers: /echo answers the body; /stream streams 3 pieces; /slow-stream streams until cancelled; /boom
    fails."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.counts: dict[tuple[str, int], int] = {}

    def count(self, path: str, status: int) -> None:
        self.counts[(path, status)] = self.counts.get((path, status), 0) + 1

    async def handle(self, req: Request) -> Response | StreamResponse:
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
        return Response(b"no", status=404)


class Server:
    def __init__(self, config: HTTPConfig) -> None:
        self.app = App()
        self.loop = asyncio.new_event_loop()
        asgi = ASGIApp(self.app.handle, config, self.app.count, watch=frozenset({"/slow-stream"}))
        self.server = HTTPServer(asgi, config)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.server.start("127.0.0.1", 0), self.loop).result(30)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server(HTTPConfig(header_read_timeout_s=1.0, body_read_timeout_s=1.0, max_body_bytes=1024))
    yield s
    s.stop()


def read_until_closed(s: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        out += data
    return out, time.monotonic() - t0


def read_responses(s: socket.socket, n: int, limit_s: float = 10.0) -> bytes:
    """Read until ``n`` complete responses with Content-Length bodies have arrived."""
    s.settimeout(limit_s)
    buf = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, rest = 0, buf
        while b"\r\n\r\n" in rest:
            head, _, rest = rest.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(rest) < length:
                break
            rest = rest[length:]
            done += 1
        if done >= n:
            return buf
        data = s.recv(65536)
        if not data:
            break
        buf += data
    return buf


def test_a_slowloris_client_is_closed_after_the_header_read_timeout(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
    s.sendall(b"X-Slow: 1\r\n")
    _, took = read_until_closed(s)
    assert 0.8 < took < 5.0


def test_idle_and_silent_connections_are_closed(srv: Server) -> None:
    silent = srv.connect()
    _, took = read_until_closed(silent)
    assert took < 5.0
    idle = srv.connect()
    idle.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
    out, took = read_until_closed(idle)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"hi") and took < 5.0


def test_an_incomplete_body_gets_408_after_the_body_timeout(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    out, took = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 408"), out[:100]
    assert took < 5.0
    assert srv.app.counts.get(("/echo", 408), 0) >= 1


def test_a_body_over_the_limit_gets_413_by_length_or_as_it_streams(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 413")
    s = srv.connect()
    chunk = b"x" * 600
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
              + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 413")
    assert srv.app.counts.get(("/echo", 413), 0) >= 2


def test_conflicting_content_length_and_transfer_encoding_never_smuggles_a_request(srv: Server) -> None:
    """Chunked wins over Content-Length (RFC 9112 §6.3) and the connection is closed after the answer, so the bytes
    after the chunked body are never read as a second request."""
    s = srv.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"2\r\nok\r\n0\r\n\r\nGET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"ok")
    assert b"HTTP/1.1 500" not in out


def test_http_1_0_and_pipelined_requests_are_answered_in_order(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"POST /echo HTTP/1.0\r\nContent-Length: 3\r\n\r\nold")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.0 200") and out.endswith(b"old")
    s = srv.connect()
    bodies = [b"@%c@" % c for c in b"abcde"]
    s.sendall(b"".join(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n" + b for b in bodies))
    out = read_responses(s, 5)
    assert out.count(b"HTTP/1.1 200") == 5
    assert [out.index(b) for b in bodies] == sorted(out.index(b) for b in bodies)


def test_a_malformed_request_line_gets_400(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"GARBAGE\x00 / HTTP/9\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 400") or out == b""


def test_a_failing_handler_answers_500_with_a_request_id_and_only_that_request(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
    out = read_responses(s, 2)
    first, _, second = out.partition(b"HTTP/1.1 200")
    assert first.startswith(b"HTTP/1.1 500")
    rid = orjson.loads(first.split(b"\r\n\r\n", 1)[1])["error"]["request_id"]
    assert rid.startswith("req-") and f"x-request-id: {rid}".encode() in first
    assert second.endswith(b"ok")


def test_a_stream_is_written_chunked_and_a_disconnect_cancels_its_handler(srv: Server) -> None:
    s = srv.connect()
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out, _ = read_until_closed(s)
    assert b"transfer-encoding: chunked" in out.lower() and all(f"data: {i}".encode() in out for i in range(3))
    s = srv.connect()
    s.sendall(b"GET /slow-stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"tick" in s.recv(4096)
    s.close()
    assert srv.app.cancelled.wait(10)


def test_http_config_refuses_values_the_server_cannot_take() -> None:
    for bad in ({"header_read_timeout_s": 0.0}, {"header_read_timeout_s": 61.0}, {"body_read_timeout_s": 0},
                {"max_body_bytes": 0}, {"max_header_bytes": 100}, {"backlog": 1}, {"max_url_bytes": 100},
                {"max_url_bytes": 100_000}):
        with pytest.raises(ValueError):
            HTTPConfig(**bad)  # type: ignore[arg-type]


def test_a_long_target_or_large_headers_get_414_or_431_and_are_counted(srv: Server) -> None:
    """The app enforces the request-target and header limits itself (counted like every response); granian (hyper)
    refuses only a head past its backstop buffer, before the app: still 431, uncounted."""
    s = srv.connect()
    s.sendall(b"GET /echo?" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 414"), out[:80]
    assert b"request target longer than 8192 bytes" in out
    s = srv.connect()
    s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 431"), out[:80]
    assert b"request headers larger than 65536 bytes" in out
    assert srv.app.counts.get(("/echo", 414)) == 1 and srv.app.counts.get(("/echo", 431)) == 1
    s = srv.connect()
    s.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 600_000 + b"\r\n\r\n")
    out, _ = read_until_closed(s)
    assert out.startswith(b"HTTP/1.1 431"), out[:80]
    assert srv.app.counts.get(("/echo", 431)) == 1  # granian's own refusal never reached the app
