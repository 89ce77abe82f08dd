"""A router's ``Session`` stream on a worker: many requests (colocated and disaggregated decodes) over one stream.

Lifecycle, as queues::

    reader thread   SessionRequest ─► refuse (draining, bad params) ──────────────► error ─┐
                                   └► engine loop: add_request, outputs routed ─► ┐        │
    engine loop     each step's outputs of this session's requests ────────────► outputs ─┴─► reply thread:
                                                                                 merged per request, paced,
                                                                                 one SessionReply per wake-up

A disaggregated ``Decode`` (``SessionRequest.decode``, for a request this worker reserved) takes the same path from
the engine loop on: its first token is handed over there (``DecodeService.deliver_op``: the lease and reservation
checks, the refusal codes) and its outputs join the session's queue; ``first_token_sent`` leaves the first token out
of its first chunk, as the ``Decode`` call does.

A request ends with its finished chunk or with an error entry (the status a ``Generate`` or ``Decode`` call would
have ended with). When the stream ends (the router closed it, went away, or the connection dropped), every request
of the session that is still running is aborted on the engine, so its blocks are freed: nothing outlives its
session.

The stream is the gRPC ``Session`` call, or a connection to :class:`SessionListener`'s plain TCP port (the same
messages as length-prefixed frames, ``wire/framing.py``, without gRPC's per-message cost); the session is the
same either way, and a connection that closes or breaks ends it like a broken call.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from auth.tls_socket import DuplexTLS
from engine.engine_loop import END, EngineLoop
from engine.llm_engine import LLMEngine, RequestOutput
from kvtransfer.sockio import close_socket
from proto.tandem.v1 import worker_pb2 as pb
from wire.framing import FrameBuffer, FrameError, frame, read_frames, tune_session_socket
from worker.convert import chunk_from_outputs, params_from_proto
from worker.parking import Parking

log = logging.getLogger(__name__)

_CLOSE = object()  # put on the outputs queue when the session ends
MAX_REPLY_CHUNKS = 1024  # chunks per SessionReply: a reply stays far below the router's 64 MiB receive limit
MAX_SESSION_CONNECTIONS = 256  # one per router process is the norm; beyond this a connection is closed at once
_TICK_S = 1.0  # how often an idle reply thread looks for requests that have produced nothing for too long


class SessionHost(Protocol):
    """What a session needs of its worker (``worker/service.py``'s WorkerService is one), so that this module does
    not import the service that imports it."""

    loop: EngineLoop
    parking: Parking
    refuse_colocated: str
    draining: bool
    worker_id: str
    request_timeout_s: float

    def abort_quietly(self, eng: LLMEngine, rid: str) -> None: ...

    def error_code(self, rid: str) -> grpc.StatusCode: ...


@dataclass(slots=True, frozen=True)
class _Failed:
    code: grpc.StatusCode
    message: str
    ends: bool = True  # False for a refused duplicate id: the live request of that id goes on


class _Route:
    """A request's sink on the engine loop: its outputs join the session's queue, tagged with its id."""

    __slots__ = ("q", "rid")

    def __init__(self, rid: str, q: queue.SimpleQueue[Any]) -> None:
        self.rid = rid
        self.q = q

    def put(self, item: RequestOutput | None) -> None:
        self.q.put((self.rid, item))


@dataclass(slots=True)
class _Relay:
    """Reply-thread state of one live request: outputs held for pacing and what was already sent. ``skip_first``: a
    Decode whose caller already streamed the first token; it is left out of the first chunk and of the count that
    pacing holds tokens for (``held`` starts at -1), as in the ``Decode`` call's relay."""

    min_chunk_tokens: int
    last_s: float
    skip_first: bool = False
    batch: list[RequestOutput] = field(default_factory=list)
    held: int = 0
    sent: int = 0


@dataclass(slots=True, frozen=True)
class _Live:
    min_chunk_tokens: int
    taken_s: float  # monotonic time the session took the request
    skip_first: bool = False


class WorkerSession:
    def __init__(self, service: SessionHost) -> None:
        self.service = service
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # request id -> how to relay it and when it was taken, for every request not yet ended
        self._live: dict[str, _Live] = {}
        self._closed = False

    # ---- reader thread -------------------------------------------------------------------------------------

    def read(self, requests: Iterable[pb.SessionRequest]) -> None:
        """Consume the router's side of the stream until it ends; then close the session."""
        try:
            for msg in requests:
                self.handle(msg)
        except grpc.RpcError:
            pass  # the stream broke: same as the router closing it
        finally:
            self.close()

    def handle(self, msg: pb.SessionRequest) -> None:
        """One message from the router (never blocks: everything goes to the engine loop as a command)."""
        if msg.generate:
            self._submit(msg.generate)
        if msg.decode:
            self._submit_decode(msg.decode)
        if msg.abort:
            self._abort(list(msg.abort))
        if msg.pause or msg.resume:
            self._pace(list(msg.pause), list(msg.resume))

    def _pace(self, pause: list[str], resume: list[str]) -> None:
        """Backpressure from the router (worker/parking.py): stop generating for requests whose client is not
        reading, and go on with those it caught up with. Any request of this worker: the router paces its
        disaggregated ``Decode`` streams over its session too."""
        parking = self.service.parking

        def pace(eng: LLMEngine) -> None:
            for rid in pause:
                parking.want(rid)
            for rid in resume:
                parking.resume(eng, rid)

        self.service.loop.call(pace)

    def _submit(self, reqs: Iterable[pb.GenerateRequest]) -> None:
        svc = self.service
        accepted: list[tuple[str, list[int], Any]] = []
        loras: dict[str, str] = {}  # request id -> its LoRA adapter (engine/lora), for those that name one
        for g in reqs:
            rid = g.request_id
            if not rid:
                continue  # nothing to answer to: a router always names its requests
            refusal = svc.refuse_colocated
            if svc.draining:
                self._fail(rid, grpc.StatusCode.UNAVAILABLE, f"worker {svc.worker_id} is draining")
                continue
            if refusal:
                self._fail(rid, grpc.StatusCode.FAILED_PRECONDITION, refusal)
                continue
            try:
                params = params_from_proto(g.params)
            except ValueError as e:
                self._fail(rid, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                continue
            with self._lock:
                if self._closed:
                    return
                if rid in self._live:
                    dup = True
                else:
                    dup = False
                    self._live[rid] = _Live(g.min_chunk_tokens, time.monotonic())
            if dup:
                self._duplicate(rid)
                continue
            accepted.append((rid, list(g.prompt_token_ids), params))
            if g.lora:
                loras[rid] = g.lora
        if not accepted:
            return

        def add(eng: LLMEngine) -> None:
            for rid, prompt, params in accepted:
                svc.loop.attach(rid, _Route(rid, self.q))
                try:
                    eng.add_request(prompt, params, rid, stream_text=True, lora=loras.get(rid))
                except ValueError as e:
                    svc.loop.detach(rid)
                    self.q.put((rid, _Failed(grpc.StatusCode.INVALID_ARGUMENT, str(e))))

        fut = svc.loop.call(add)
        fut.add_done_callback(lambda f: self._lost(f, [rid for rid, _, _ in accepted]))

    def _duplicate(self, rid: str) -> None:
        self.q.put((rid, _Failed(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid} is already live", ends=False)))

    def _submit_decode(self, reqs: Iterable[pb.DecodeRequest]) -> None:
        """Disaggregated decodes of requests this worker reserved: what the ``Decode`` call does, with the
        session's queue as the sink. A refusal (no reservation, its transfer failed, the first token refused) ends
        the request with the status ``Decode`` would have ended with. Not refused while draining: a reserved
        request is the worker's to finish, as on the ``Decode`` call."""
        svc = self.service
        deliver_op: Any = getattr(svc, "deliver_op", None)  # worker/decode_service.py's DecodeService
        accepted: list[pb.DecodeRequest] = []
        for d in reqs:
            rid = d.request_id
            if not rid:
                continue
            if deliver_op is None:
                self._fail(rid, grpc.StatusCode.FAILED_PRECONDITION, "this worker does not decode")
                continue
            with self._lock:
                if self._closed:
                    return
                dup = rid in self._live
                if not dup:
                    self._live[rid] = _Live(d.min_chunk_tokens, time.monotonic(), d.first_token_sent)
            if dup:
                self._duplicate(rid)
                continue
            accepted.append(d)
        if not accepted:
            return
        ops = [(d.request_id, deliver_op(d, _Route(d.request_id, self.q))) for d in accepted]
        refusal_code: Any = getattr(svc, "refusal_code")  # noqa: B009  # a DecodeService, as deliver_op says

        def deliver(eng: LLMEngine) -> None:
            for rid, op in ops:
                try:
                    got = op(eng)
                except Exception as e:  # one request's failure is its own: the others are delivered
                    log.exception("session decode of %s failed", rid)
                    self.q.put((rid, _Failed(grpc.StatusCode.INTERNAL, f"request {rid}: {e}")))
                    continue
                if isinstance(got, str):
                    self.q.put((rid, _Failed(refusal_code(rid), f"request {rid}: {got}")))

        fut = svc.loop.call(deliver)
        fut.add_done_callback(lambda f: self._lost(f, [d.request_id for d in accepted]))

    def _lost(self, fut: Any, rids: list[str]) -> None:
        """The engine loop could not take the requests (it stopped): each one fails instead of waiting."""
        if fut.cancelled() or fut.exception() is not None:
            for rid in rids:
                self.q.put((rid, _Failed(grpc.StatusCode.UNAVAILABLE, "engine loop stopped")))

    def _fail(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        self.q.put((rid, _Failed(code, message)))

    def _abort(self, rids: list[str]) -> None:
        svc = self.service

        def abort(eng: LLMEngine) -> None:
            for rid in rids:
                svc.abort_quietly(eng, rid)

        svc.loop.call(abort)

    def close(self) -> None:
        """End the session (idempotent, any thread): abort what is still running, then end the replies."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live)
            self._live.clear()
        if live:
            self._abort(live)
        self.q.put(_CLOSE)

    # ---- reply thread --------------------------------------------------------------------------------------

    def replies(self) -> Iterator[pb.SessionReply]:
        relays: dict[str, _Relay] = {}
        timeout_s = self.service.request_timeout_s
        next_check = time.monotonic() + _TICK_S
        while True:
            try:
                item = self.q.get(timeout=_TICK_S)
            except queue.Empty:
                item = None
            chunks: list[pb.SessionChunk] = []
            touched: set[str] = set()
            closing = False
            while item is not None:
                if item is _CLOSE:
                    closing = True
                    break
                self._take(item, relays, touched, chunks)
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    item = None
            for rid in touched:
                r = relays.get(rid)
                if r is not None and r.batch and (r.batch[-1].finished or r.held >= r.min_chunk_tokens):
                    c = self._chunk(rid, r, relays)
                    if c is not None:
                        chunks.append(c)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _TICK_S
                chunks.extend(self._expire(relays, now, timeout_s))
            for i in range(0, len(chunks), MAX_REPLY_CHUNKS):  # bounded messages, however much was waiting
                yield pb.SessionReply(chunks=chunks[i:i + MAX_REPLY_CHUNKS])
            if closing:
                return

    def _expire(self, relays: dict[str, _Relay], now: float, timeout_s: float) -> list[pb.SessionChunk]:
        """End (and abort) every live request that has produced nothing for ``timeout_s``: since its last output,
        or since it was taken if it has produced none yet (stuck waiting)."""
        with self._lock:
            live = list(self._live.items())
        stale = []
        for rid, entry in live:
            r = relays.get(rid)
            if now - (r.last_s if r is not None else entry.taken_s) > timeout_s:
                stale.append(rid)
        if not stale:
            return []
        for rid in stale:
            relays.pop(rid, None)
            self._ended(rid)
        self._abort(stale)
        return [pb.SessionChunk(request_id=rid, error_code=_code(grpc.StatusCode.DEADLINE_EXCEEDED),
                                error=f"request {rid} produced nothing for {timeout_s:g} s") for rid in stale]

    def _take(self, item: tuple[str, Any], relays: dict[str, _Relay], touched: set[str],
              chunks: list[pb.SessionChunk]) -> None:
        rid, out = item
        if isinstance(out, _Failed):
            if out.ends:
                relays.pop(rid, None)
                self._ended(rid)
            chunks.append(pb.SessionChunk(request_id=rid, error_code=_code(out.code), error=out.message))
            return
        r = relays.get(rid)
        if out is END:
            if r is not None and not (r.batch and r.batch[-1].finished):  # no final output: the loop died under it
                del relays[rid]
                self._ended(rid)
                err = self.service.loop.error
                chunks.append(pb.SessionChunk(request_id=rid, error_code=_code(grpc.StatusCode.INTERNAL),
                                              error=f"engine failed: {err}" if err else f"request {rid} was dropped"))
            return
        if r is None:
            with self._lock:
                entry = self._live.get(rid)
            if entry is None:
                return  # ended (closed, expired) under it; the abort is on its way
            r = relays[rid] = _Relay(entry.min_chunk_tokens, time.monotonic(), entry.skip_first,
                                     held=-1 if entry.skip_first else 0)
        if out.finish_reason == "error":
            del relays[rid]
            self._ended(rid)
            code = self.service.error_code(rid)
            chunks.append(pb.SessionChunk(request_id=rid, error_code=_code(code),
                                          error=out.new_text or f"request {rid} failed"))
            return
        r.batch.append(out)
        r.held += len(out.new_token_ids)
        r.last_s = time.monotonic()
        touched.add(rid)

    def _chunk(self, rid: str, r: _Relay, relays: dict[str, _Relay]) -> pb.SessionChunk | None:
        """The held outputs as one chunk; None when nothing is left to send (a Decode's first output carried only
        the first token, which its caller already has)."""
        chunk = chunk_from_outputs(r.batch, r.sent)
        if r.skip_first and not r.sent:
            chunk = without_first_token(chunk, r.batch[0])
            r.held += 1  # ``sent`` indexes the request's outputs, the skipped first token included
        r.sent += r.held
        r.held = 0
        if r.batch[-1].finished:
            del relays[rid]
            self._ended(rid)
        r.batch = []
        if not chunk.token_ids and not chunk.finish_reason:
            return None
        return pb.SessionChunk(request_id=rid, chunk=chunk)

    def _ended(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)


def without_first_token(chunk: pb.TokenChunk, first: RequestOutput) -> pb.TokenChunk:
    """A stream's first chunk less its first token (and that token's logprob and text), which the caller already
    streamed from ``PrefillResponse``; ``first`` is the output that carried it."""
    if chunk.token_ids:
        del chunk.token_ids[0]
    if chunk.logprobs:
        del chunk.logprobs[0]
    chunk.text = chunk.text[len(first.new_text):]
    return chunk


def _frames(stream: socket.socket | DuplexTLS) -> Iterator[bytes]:
    """Frames off a connection, plain or TLS, until the peer closes it; raises OSError or FrameError."""
    if isinstance(stream, socket.socket):
        yield from read_frames(stream)
        return
    buf = FrameBuffer()
    while data := stream.recv(1 << 20):
        yield from buf.feed(data)


def _code(code: grpc.StatusCode) -> int:
    value: int = code.value[0]
    return value


class SessionListener:
    """The plain-TCP ``Session`` transport (wire/framing.py): the same ``WorkerSession`` as the gRPC handler,
    without gRPC's per-message cost (~200 µs of CPU per message on the router's side alone in grpc.aio).

    One thread accepts; each connection gets a reader thread (frames → ``WorkerSession.read``) and a writer thread
    (``WorkerSession.replies`` → frames). A connection that closes, breaks or sends a bad frame ends its session,
    which aborts every request still running on it, exactly as a broken gRPC stream does.

    With ``tls`` (a server context that requires a client certificate, auth/tls.py) each connection first completes
    a mutual TLS handshake in its own thread: a client without a certificate from the cluster's CA is dropped
    before it can send a request."""

    def __init__(self, service: SessionHost, host: str, port: int = 0,
                 max_connections: int = MAX_SESSION_CONNECTIONS, tls: ssl.SSLContext | None = None) -> None:
        self.service = service
        self.max_connections = max_connections
        self.tls = tls
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="session-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:  # each connection holds threads: a flood of them must not exhaust the worker
                log.warning("session port: refusing a connection beyond %d", self.max_connections)
                conn.close()
                continue
            conn.settimeout(None)
            tune_session_socket(conn)
            threading.Thread(target=self._serve, args=(conn,), name="session-tcp", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        stream: socket.socket | DuplexTLS = conn
        if self.tls is not None:
            try:
                stream = DuplexTLS.accept(conn, self.tls)
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: no or a foreign client certificate
                log.warning("session port: TLS handshake refused: %s", e)
                close_socket(conn)
                with self._lock:
                    self._conns.discard(conn)
                return
        session = WorkerSession(self.service)

        def requests() -> Iterator[pb.SessionRequest]:
            try:
                for data in _frames(stream):
                    yield pb.SessionRequest.FromString(data)
            except (OSError, FrameError, DecodeError) as e:
                log.info("session connection ended: %s", e)

        threading.Thread(target=session.read, args=(requests(),), name="session-reader", daemon=True).start()
        try:
            for reply in session.replies():
                stream.sendall(frame(reply.SerializeToString()))
        except OSError:
            pass  # the router is gone: the session ends below
        finally:
            session.close()
            if isinstance(stream, DuplexTLS):
                stream.close()
            close_socket(conn)  # shut down first: the reader's recv returns, so its thread ends too
            with self._lock:
                self._conns.discard(conn)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(2.0)
