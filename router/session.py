"""The router's end of a worker's ``Session`` stream: colocated requests multiplexed over one gRPC stream.

A ``Generate`` call per request costs ~200 µs of CPU on each side in Python gRPC (call setup, its completion
queue, a thread hop on the worker); on a session a request is an entry in the next batched message, a few µs.

Queues (all on the router's event loop)::

    generate() ─► outgoing batch ─► writer task: one SessionRequest per wake-up ─► worker
    worker ─► reader task: SessionReply ─► per-request chunk list ─► the generate() waiting on it

Requests written while a write is in flight, or in the same loop iteration, share the next message. Each request
ends with its finished chunk, an error entry from the worker (raised as :class:`SessionError` with the status a
``Generate`` call would have ended with), its deadline (checked every ``_SWEEP_S``), or the session breaking:
then every request on it fails with ``UNAVAILABLE`` and the next request opens a fresh stream. A request given up
early (its consumer closed the generator: client gone, deadline) is aborted through the session. The worker
aborts whatever is still running when the stream ends, so a router that crashes leaks no blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc

from proto.tandem.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
MAX_BATCH_REQUESTS = 1024  # requests per SessionRequest
MAX_BATCH_TOKENS = 1 << 21  # prompt tokens per SessionRequest (~2M tokens: ~6-10 MB on the wire)
_SWEEP_S = 0.25  # how often deadlines are checked while requests are in flight: a deadline is late by at most this


class SessionError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Pending:
    """One request's chunks as they arrive, and the future its consumer is parked on (if it is).

    With a ``sink`` (``collect``, ``submit``), each chunk is handed to it as it is read instead of queued, and
    the waiter is woken (or ``on_done`` called) once, at the end."""

    __slots__ = ("chunks", "deadline", "error", "on_done", "sink", "waiter")

    def __init__(self, deadline: float, sink: Callable[[pb.TokenChunk], bool] | None = None) -> None:
        self.chunks: deque[pb.TokenChunk] = deque()
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


class WorkerSession:
    def __init__(self, stub: Any, name: str = "") -> None:
        self._stub = stub
        self.name = name
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, _Pending] = {}
        self._out_generate: list[pb.GenerateRequest] = []
        self._out_abort: list[str] = []
        self._writing = False
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None
        self.opened = 0  # streams opened so far (a broken one is replaced on the next request)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def generate(self, request: pb.GenerateRequest, timeout_s: float) -> AsyncGenerator[pb.TokenChunk, None]:
        """Yield ``request``'s chunks through the last (finish_reason set); raise SessionError on failure."""
        loop = asyncio.get_running_loop()
        rid = request.request_id
        p = self._submit(loop, request, timeout_s, None)
        try:
            while True:
                if p.chunks:
                    chunk = p.chunks.popleft()
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

    def _submit(self, loop: asyncio.AbstractEventLoop, request: pb.GenerateRequest, timeout_s: float,
                sink: Callable[[pb.TokenChunk], bool] | None) -> _Pending:
        if self._closed:
            raise SessionError(grpc.StatusCode.UNAVAILABLE, f"session to {self.name} is closed")
        rid = request.request_id
        if rid in self._pending:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid} is already in flight")
        p = _Pending(loop.time() + timeout_s, sink)
        self._pending[rid] = p
        self._ensure_open()
        self._out_generate.append(request)
        self._kick()
        if self._sweeper is None:
            self._sweeper = loop.call_later(_SWEEP_S, self._sweep)
        return p

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
            self._call = self._stub.Session()
            self.opened += 1
            self._reader = asyncio.get_running_loop().create_task(self._read(self._call))

    def _kick(self) -> None:
        if not self._writing and self._call is not None:
            self._writing = True
            asyncio.get_running_loop().create_task(self._write(self._call))

    async def _write(self, call: Any) -> None:
        try:
            while (self._out_generate or self._out_abort) and call is self._call:
                await call.write(self._next_message())
        except Exception as e:  # any failed write (RPC error, finished call, ...) leaves the stream unusable
            self._broken(call, grpc.StatusCode.UNAVAILABLE, f"session write failed: {e!r}")
        finally:
            self._writing = False
            if (self._out_generate or self._out_abort) and self._call is not None and self._call is not call:
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
        self._out_generate = out[n:]
        self._out_abort = []
        return msg

    async def _read(self, call: Any) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the session"
        try:
            async for reply in call:
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
                        if c.chunk.finish_reason:
                            del pending[c.request_id]
                    p.wake()
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or "session stream failed"
            if code == grpc.StatusCode.CANCELLED and self._closed:
                return
        except asyncio.CancelledError:
            self._broken(call, grpc.StatusCode.CANCELLED, "router shutting down")
            raise
        self._broken(call, code, details)

    def _broken(self, call: Any, code: grpc.StatusCode, details: str) -> None:
        """The stream ``call`` is gone: fail everything on it, so the next request opens another."""
        if call is not self._call:
            return
        self._call = None
        self._out_generate = []
        self._out_abort = []
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
