"""The router's end of a worker's ``Session`` stream: requests multiplexed over one stream.

Colocated requests (``generate``) and the ``Decode`` step of disaggregated ones (``decode``, router/dispatch.py)
travel the same way: one entry in the next batched message out, their chunks batched per engine step back.

A ``Generate`` call per request costs CPU on each side for every request in Python gRPC (call setup, its
completion queue, a thread hop on the worker); on a session a request is an entry in the next batched message
(the A/B is change 1 of docs/benchmarks.md section 5).

Queues (all on the router's event loop)::

    generate() ─► outgoing batch ─► writer task: one SessionRequest per wake-up ─► worker
    worker ─► reader task: SessionReply ─► per-request chunk list ─► the generate() waiting on it

Requests written while a write is in flight, or in the same loop iteration, share the next message. Each request
ends with its finished chunk, an error entry from the worker (raised as :class:`SessionError` with the status a
``Generate`` call would have ended with), its deadline (checked every ``_SWEEP_S``), or the session breaking:
then every request on it fails with ``UNAVAILABLE`` and the next request opens a fresh stream. A request given up
early (its consumer closed the generator: client gone, deadline) is aborted through the session. The worker
aborts whatever is still running when the stream ends, so a router that crashes leaks no blocks.

Backpressure: a request read by ``generate`` whose consumer is slower than the worker (a client reading its SSE
stream slowly) has at most ``max_buffered_tokens`` waiting here. Past that bound the session sends ``pause`` for
it and the worker stops generating it (``worker/parking.py``: the request keeps its blocks); once the consumer has
taken the buffer down to half, ``resume``. So neither the router's memory nor the worker's work for a slow reader
grows with its ``max_tokens``; a request paused past the worker's stall timeout fails with a clear error. The
session's own stream is never paused: one slow reader does not hold back the other requests on it.

Two transports carry the same messages. The gRPC ``Session`` call is always there; when a worker's health answer
names a ``session_port``, new streams open a plain TCP connection to it instead, with length-prefixed frames
(``wire/framing.py``): one ``write`` and one ``data_received`` per message, where a grpc.aio round trip costs the
router the same CPU whatever the batch (docs/benchmarks.md section 5, change 8). A lost connection breaks the
session exactly as a broken call does; a port that cannot be reached sends the session (and what was written to
it) back to gRPC for a while. With TLS (``tls``: the pool's client context, auth/tls.py) the TCP connection is
mutual TLS, as the gRPC channel is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from proto.tandem.v1 import worker_pb2 as pb
from wire.framing import FrameBuffer, FrameError, frame, tune_session_socket

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
MAX_BATCH_REQUESTS = 1024  # requests per SessionRequest
MAX_BATCH_TOKENS = 1 << 21  # prompt tokens per SessionRequest (~2M tokens: ~6-10 MB on the wire)
_SWEEP_S = 0.25  # how often deadlines are checked while requests are in flight: a deadline is late by at most this
MAX_BUFFERED_TOKENS = 256  # a streamed request's tokens waiting for its consumer before the worker pauses it


class SessionError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Pending:
    """One request's chunks as they arrive, and the future its consumer is parked on (if it is).

    With a ``sink`` (``collect``, ``submit``), each chunk is handed to it as it is read instead of queued, and
    the waiter is woken (or ``on_done`` called) once, at the end."""

    __slots__ = ("buffered", "chunks", "deadline", "error", "limit", "on_done", "paused", "sink", "waiter")

    def __init__(self, deadline: float, sink: Callable[[pb.TokenChunk], bool] | None = None, limit: int = 0) -> None:
        self.chunks: deque[pb.TokenChunk] = deque()
        self.buffered = 0  # tokens in ``chunks``
        self.limit = limit  # pause the request on the worker past this many buffered tokens (0: never)
        self.paused = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.deadline = deadline  # loop.time() after which it fails with DEADLINE_EXCEEDED
        self.sink = sink
        self.on_done: Callable[[BaseException | None], None] | None = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)
        done = self.on_done
        if done is not None:
            self.on_done = None
            try:
                done(self.error)
            except Exception:
                log.exception("a session request's completion callback failed")


def host_of(address: str) -> str:
    """The host of a ``host:port`` worker address (an IPv6 host loses its brackets): where its session port is."""
    return address.rsplit(":", 1)[0].strip("[]")


class WorkerSession:
    def __init__(self, stub: Any, name: str = "", tls: tuple[ssl.SSLContext, str | None] | None = None) -> None:
        """``tls``: (client context, the name the worker's certificate carries or None for the host dialled)."""
        self._stub = stub
        self.name = name
        self.tls = tls
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, _Pending] = {}
        self._out_generate: list[pb.GenerateRequest] = []
        self._out_decode: list[pb.DecodeRequest] = []
        self._out_abort: list[str] = []
        self._out_pace: dict[str, bool] = {}  # request id -> pause (True) or resume (False), sent with the next message
        self._writing = False
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None
        self.opened = 0  # streams opened so far (a broken one is replaced on the next request)
        self.last_received = 0.0  # monotonic time of the worker's last reply: it is alive (router/pool.py)
        # The worker's plain-TCP Session transport (host, port), once its health answer names one: new streams
        # use it instead of the gRPC Session (same messages, without grpc.aio's CPU per message).
        self.tcp: tuple[str, int] | None = None
        self.unreachable: tuple[str, int] | None = None  # the last TCP port that could not be reached
        self._unreachable_until = 0.0

    def use_tcp(self, host: str, port: int) -> None:
        """Open later streams on the worker's TCP Session port (0: back to gRPC). A port found unreachable is
        not tried again for ``UNREACHABLE_RETRY_S``: meanwhile streams stay on gRPC, which reaches the worker."""
        tcp = (host, port) if port else None
        if tcp is not None and tcp == self.unreachable and time.monotonic() < self._unreachable_until:
            return
        self.tcp = tcp

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def decode(self, request: pb.DecodeRequest, timeout_s: float,
               max_buffered_tokens: int = MAX_BUFFERED_TOKENS) -> AsyncGenerator[pb.TokenChunk, None]:
        """A disaggregated request's ``Decode`` on this session (the worker reserved it): ``generate``'s chunks,
        errors (the status the ``Decode`` call would have ended with) and backpressure."""
        return self.generate(request, timeout_s, max_buffered_tokens)

    async def generate(self, request: pb.GenerateRequest | pb.DecodeRequest, timeout_s: float,
                       max_buffered_tokens: int = MAX_BUFFERED_TOKENS) -> AsyncGenerator[pb.TokenChunk, None]:
        """Yield ``request``'s chunks through the last (finish_reason set); raise SessionError on failure. At most
        ``max_buffered_tokens`` wait for the consumer: beyond, the worker pauses the request until it catches up.
        A ``DecodeRequest`` is a disaggregated request's decode (``decode``)."""
        loop = asyncio.get_running_loop()
        rid = request.request_id
        p = self._submit(loop, request, timeout_s, None, max_buffered_tokens)
        try:
            while True:
                if p.chunks:
                    chunk = p.chunks.popleft()
                    p.buffered -= len(chunk.token_ids)
                    if p.paused and p.buffered <= p.limit // 2 and not chunk.finish_reason:
                        p.paused = False
                        self._pace(rid, False)
                    yield chunk
                    if chunk.finish_reason:
                        return
                    continue
                if p.error is not None:
                    raise p.error
                p.waiter = loop.create_future()
                await p.waiter
                p.waiter = None
        finally:
            self._give_up(rid, p)

    async def collect(self, request: pb.GenerateRequest, timeout_s: float,
                      sink: Callable[[pb.TokenChunk], bool]) -> None:
        """Run ``request``, handing each chunk to ``sink`` as it arrives; return after the last one, or as soon as
        ``sink`` returns True (the consumer has what it needs: the rest is aborted on the worker). Raise
        SessionError on failure. One future per request instead of a generator step per chunk: the path of a
        request answered only at its end."""
        loop = asyncio.get_running_loop()
        p = self._submit(loop, request, timeout_s, sink)
        waiter = p.waiter = loop.create_future()
        try:
            await waiter
            if p.error is not None:
                raise p.error
        finally:
            self._give_up(request.request_id, p)

    def submit(self, request: pb.GenerateRequest, timeout_s: float, sink: Callable[[pb.TokenChunk], bool],
               on_done: Callable[[BaseException | None], None]) -> Callable[[], None]:
        """``collect`` as callbacks, with no task or future: ``on_done(None)`` after the last chunk (or once
        ``sink`` returned True), ``on_done(error)`` on failure, called once either way. Returns a function that
        gives the request up (aborted on the worker; ``on_done`` is then never called). Raises SessionError if
        it cannot be sent at all."""
        p = self._submit(asyncio.get_running_loop(), request, timeout_s, sink)
        p.on_done = on_done
        rid = request.request_id

        def cancel() -> None:
            p.on_done = None
            self._give_up(rid, p)

        return cancel

    def _submit(self, loop: asyncio.AbstractEventLoop, request: pb.GenerateRequest | pb.DecodeRequest, timeout_s: float,
                sink: Callable[[pb.TokenChunk], bool] | None, limit: int = 0) -> _Pending:
        if self._closed:
            raise SessionError(grpc.StatusCode.UNAVAILABLE, f"session to {self.name} is closed")
        rid = request.request_id
        if rid in self._pending:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid} is already in flight")
        p = _Pending(loop.time() + timeout_s, sink, limit)
        self._pending[rid] = p
        self._ensure_open()
        if isinstance(request, pb.DecodeRequest):
            self._out_decode.append(request)
        else:
            self._out_generate.append(request)
        self._kick()
        if self._sweeper is None:
            self._sweeper = loop.call_later(_SWEEP_S, self._sweep)
        return p

    def _pace(self, rid: str, pause: bool) -> None:
        if not self._closed and self._call is not None:
            self._out_pace[rid] = pause
            self._kick()

    def pace(self, rid: str, pause: bool) -> None:
        """Pause (or resume) request ``rid`` on the worker, whichever call carries it (a disaggregated ``Decode``
        stream too: router/dispatch.py); opens the session's stream if none is open."""
        if self._closed:
            return
        self._ensure_open()
        self._pace(rid, pause)

    def _has_out(self) -> bool:
        return bool(self._out_generate or self._out_decode or self._out_abort or self._out_pace)

    def _give_up(self, rid: str, p: _Pending) -> None:
        if self._pending.get(rid) is p:  # given up before its end: stop it on the worker
            del self._pending[rid]
            if not self._closed and self._call is not None:
                self._out_abort.append(rid)
                self._kick()

    def _sweep(self) -> None:
        """Fail (and abort) requests past their deadline: one timer per session, not one per request."""
        self._sweeper = None
        if not self._pending:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for rid in [rid for rid, p in self._pending.items() if p.deadline <= now]:
            p = self._pending.pop(rid)
            self._out_abort.append(rid)
            p.error = SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer before the request's deadline")
            p.wake()
        self._kick()
        if self._pending and not self._closed:
            self._sweeper = loop.call_later(_SWEEP_S, self._sweep)

    def _ensure_open(self) -> None:
        if self._call is None:
            self.opened += 1
            if self.tcp is not None:
                self._call = _TcpStream(self, *self.tcp)
            else:
                self._call = self._stub.Session()
                self._reader = asyncio.get_running_loop().create_task(self._read(self._call))

    def _kick(self) -> None:
        call = self._call
        if self._writing or call is None:
            return
        self._writing = True
        if isinstance(call, _TcpStream):  # writes do not block: one flush per loop iteration batches them
            asyncio.get_running_loop().call_soon(self._flush, call)
        else:
            asyncio.get_running_loop().create_task(self._write(call))

    def _flush(self, call: _TcpStream) -> None:
        self._writing = False
        if call is not self._call:
            return
        while self._has_out() and not call.paused:
            call.write(self._next_message())

    async def _write(self, call: Any) -> None:
        try:
            while self._has_out() and call is self._call:
                await call.write(self._next_message())
        except Exception as e:  # any failed write (RPC error, finished call, ...) leaves the stream unusable
            self._broken(call, grpc.StatusCode.UNAVAILABLE, f"session write failed: {e!r}")
        finally:
            self._writing = False
            if self._has_out() and self._call is not None and self._call is not call:
                self._kick()  # a new stream was opened while this one was failing

    def _next_message(self) -> pb.SessionRequest:
        """The queued aborts and as many queued requests as fit in one message: at most ``MAX_BATCH_REQUESTS``
        and ``MAX_BATCH_TOKENS`` prompt tokens (at least one request), far below the workers' 64 MiB receive limit
        however long the prompts; the rest goes in the next message."""
        out = self._out_generate
        n, tokens = 0, 0
        while n < len(out) and n < MAX_BATCH_REQUESTS:
            tokens += len(out[n].prompt_token_ids)
            if n and tokens > MAX_BATCH_TOKENS:
                break
            n += 1
        msg = pb.SessionRequest(generate=out[:n], abort=self._out_abort)
        if self._out_decode:  # small and few per message (one per request that finished its prefill meanwhile)
            msg.decode.extend(self._out_decode)
            self._out_decode = []
        if self._out_pace:
            msg.pause.extend(rid for rid, pause in self._out_pace.items() if pause)
            msg.resume.extend(rid for rid, pause in self._out_pace.items() if not pause)
            self._out_pace = {}
        self._out_generate = out[n:]
        self._out_abort = []
        return msg

    async def _read(self, call: Any) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the session"
        try:
            async for reply in call:
                self._deliver(reply)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or "session stream failed"
            if code == grpc.StatusCode.CANCELLED and self._closed:
                return
        except asyncio.CancelledError:
            self._broken(call, grpc.StatusCode.CANCELLED, "router shutting down")
            raise
        self._broken(call, code, details)

    def _deliver(self, reply: pb.SessionReply) -> None:
        """One reply's chunks to their requests."""
        self.last_received = time.monotonic()
        pending = self._pending
        for c in reply.chunks:
            p = pending.get(c.request_id)
            if p is None:
                continue  # given up or expired here; its abort is on its way
            if c.error_code:
                del pending[c.request_id]
                p.error = SessionError(_CODES.get(c.error_code, grpc.StatusCode.UNKNOWN), c.error)
            elif p.sink is not None:
                chunk = c.chunk
                try:
                    done = p.sink(chunk)
                except Exception as e:  # the consumer's failure is its own, not the session's
                    p.error, done = e, True
                if not done and not chunk.finish_reason:
                    continue  # more to come: the consumer sleeps on
                del pending[c.request_id]
                if not chunk.finish_reason and not self._closed:  # the consumer is done: stop the rest
                    self._out_abort.append(c.request_id)
                    self._kick()
            else:
                p.chunks.append(c.chunk)
                p.buffered += len(c.chunk.token_ids)
                if c.chunk.finish_reason:
                    del pending[c.request_id]
                elif p.limit and p.buffered > p.limit and not p.paused:  # the consumer is behind: stop the worker
                    p.paused = True
                    self._pace(c.request_id, True)
            p.wake()

    def _unreachable(self, call: _TcpStream, address: tuple[str, int], written: list[pb.SessionRequest]) -> None:
        """``call`` could not connect to the worker's TCP port: streams stay on gRPC from now on, and what was
        written to ``call`` (requests still pending here) goes first on a new gRPC stream."""
        self.unreachable = address
        self._unreachable_until = time.monotonic() + UNREACHABLE_RETRY_S
        if self.tcp == address:
            self.tcp = None
        if call is not self._call:
            return
        self._call = None
        if self._closed:
            return
        resend = [g for m in written for g in m.generate if g.request_id in self._pending]
        resend_decode = [d for m in written for d in m.decode if d.request_id in self._pending]
        if not resend and not resend_decode and not self._out_generate and not self._out_decode:
            return
        self._out_generate[:0] = resend
        self._out_decode[:0] = resend_decode
        self._ensure_open()
        self._kick()

    def _broken(self, call: Any, code: grpc.StatusCode, details: str) -> None:
        """The stream ``call`` is gone: fail everything on it, so the next request opens another."""
        if call is not self._call:
            return
        self._call = None
        self._out_generate = []
        self._out_decode = []
        self._out_abort = []
        self._out_pace = {}
        if self._pending:
            log.warning("session to %s broke with %d requests in flight: %s %s", self.name, len(self._pending),
                        code.name, details)
        pending, self._pending = self._pending, {}
        err = SessionError(code, details)
        for p in pending.values():
            p.error = err
            p.wake()
        with contextlib.suppress(Exception):
            call.cancel()

    def sever(self, why: str) -> None:
        """Break the current stream now (the worker stopped answering): every request on it fails with
        ``UNAVAILABLE``; the next request opens a fresh stream."""
        if self._call is not None:
            self._broken(self._call, grpc.StatusCode.UNAVAILABLE, why)

    async def close(self) -> None:
        """End the stream: the worker aborts every request still on it."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        call, reader = self._call, self._reader
        if call is not None:
            self._broken(call, grpc.StatusCode.UNAVAILABLE, f"session to {self.name} is closed")
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


_CONNECT_TIMEOUT_S = 5.0
UNREACHABLE_RETRY_S = 60.0  # how long a session stays on gRPC after its worker's TCP port could not be reached


class _TcpStream(asyncio.Protocol):
    """One Session stream on the worker's plain-TCP transport (wire/framing.py), standing where a grpc.aio call
    would: ``write`` (never blocks: buffered until connected, and the session stops flushing while the transport
    is paused), ``cancel``; replies go to ``WorkerSession._deliver`` as their frames complete. A port that cannot be
    reached sends the session back to gRPC (``WorkerSession._unreachable``); a lost connection or a bad frame
    breaks the session (every request on it fails with ``UNAVAILABLE``)."""

    def __init__(self, session: WorkerSession, host: str, port: int) -> None:
        self.session = session
        self.paused = False
        self._transport: asyncio.Transport | None = None
        self._early: list[pb.SessionRequest] = []  # messages written before the connection is up
        self._frames = FrameBuffer()
        self._done = False
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_task(self._connect(loop, host, port))

    async def _connect(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        tls = self.session.tls
        try:
            if tls is None:
                connect = loop.create_connection(lambda: self, host, port)
            else:
                connect = loop.create_connection(lambda: self, host, port, ssl=tls[0], server_hostname=tls[1] or host)
            await asyncio.wait_for(connect, _CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            # Unreachable (a firewall, a port the network does not route, a worker that just died): what was
            # written goes on a gRPC stream instead, and so do later streams, rather than failing every request
            # on a port that cannot be reached. A dead worker fails them there, as it would have anyway.
            why = str(e) or "timed out"
            log.warning("worker session port %s:%d unreachable (%s): using the gRPC Session stream", host, port, why)
            early, self._early = self._early, []
            self._done = True
            self.session._unreachable(self, (host, port), early)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self._done:
            transport.close()
            return
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                tune_session_socket(sock)
        if self._early:
            transport.write(b"".join(frame(m.SerializeToString()) for m in self._early))
            self._early = []

    def write(self, msg: pb.SessionRequest) -> None:
        if self._transport is not None:
            self._transport.write(frame(msg.SerializeToString()))
        elif not self._done:
            self._early.append(msg)

    def data_received(self, data: bytes) -> None:
        if self._done:  # broken or cancelled here: what still arrives belongs to requests already failed
            return
        try:
            frames = self._frames.feed(data)
            for f in frames:
                self.session._deliver(pb.SessionReply.FromString(f))
        except (FrameError, DecodeError) as e:
            self._gone(f"bad frame from the worker: {e}")

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.session._kick()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone(f"session connection lost: {exc or 'closed by the worker'}")

    def _gone(self, why: str) -> None:
        if not self._done:
            self.session._broken(self, grpc.StatusCode.UNAVAILABLE, why)
            self.cancel()

    def cancel(self) -> None:
        self._done = True
        self._early = []
        if self._transport is not None:
            self._transport.close()
        elif not self._connecting.done():
            self._connecting.cancel()
