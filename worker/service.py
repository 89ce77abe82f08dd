"""The gRPC service every worker role shares: colocated generation, abort, health, load, KV events, drain.

This class is the thread-per-call servicer (``grpc.server``, for in-process use); ``tandem worker`` serves the same
service through ``worker/aio_service.py`` on ``grpc.aio``, where a stream holds no thread. Both share the engine
commands defined here (``*_op``), the parking of requests whose client is not reading (``worker/parking.py``) and
the in-flight count that drain waits on (``in_flight``: unfinished requests, parked ones and the role's pending
KV transfers).

Threads: gRPC handler threads block on per-request queues; the :class:`EngineLoop` thread owns the engine. KV
events are copied off the engine after every step into a bounded ring (with sequence numbers), from which every
``KVEvents`` subscriber reads; a subscriber that falls behind the ring sees a sequence gap and resyncs with
``Snapshot``.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from engine.block_pool import KVEventBatch
from engine.engine_loop import END, EngineLoop
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import RequestStatus
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.convert import chunk_from_outputs, params_from_proto
from worker.lora_admin import adapter_infos
from worker.parking import Parking
from worker.session import WorkerSession, without_first_token

EVENT_RING = 4096
STALL_TIMEOUT_S = 60.0  # a request paused for its client (backpressure) this long fails


class WorkerService(pb_grpc.WorkerServicer):
    role = "both"
    refuse_colocated = ""  # why this role serves no colocated generation (Generate, Session), or ""
    session_port = 0  # the plain-TCP Session transport's port (worker/session.py SessionListener), 0 if none

    def __init__(self, engine: LLMEngine, kv_backend: str = "none", worker_id: str | None = None,
                 request_timeout_s: float = 600.0, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.generated_tokens = 0  # output tokens published, over every request (loop thread)
        publish = self.loop.publish

        def counted(out: RequestOutput) -> None:
            self.generated_tokens += len(out.new_token_ids)
            publish(out)

        self.loop.publish = counted  # type: ignore[method-assign]
        self.parking = Parking(stall_timeout_s, self.fail_request)
        self.worker_id = worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.kv_backend = kv_backend
        self.request_timeout_s = request_timeout_s
        self.draining = False
        self._events: deque[KVEventBatch] = deque(maxlen=EVENT_RING)
        self._events_cv = threading.Condition()
        self.event_listeners: set[Callable[[], None]] = set()  # called (loop thread) after each new batch
        self.publisher: Any = None  # worker.redis_bus.RedisPublisher when a Redis URL is configured
        self.replica: Any = None  # engine.parallel.replica.ServedReplica when the engine has ranks (--tp/--pp/--ep)
        self.loop.add_hook(self._collect_events)
        self.loop.add_hook(lambda: self.parking.poll(self.engine))

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        if self.publisher is not None:
            self.publisher.stop()
        self.loop.stop()
        with self._events_cv:
            self._events_cv.notify_all()

    @property
    def compat_hash(self) -> str:
        return ""

    def _reject_if_draining(self, context: grpc.ServicerContext) -> None:
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")

    # ---- generation (colocated) ------------------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        if self.refuse_colocated:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse_colocated)
        self._reject_if_draining(context)
        params = self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex

        def add(eng: LLMEngine) -> queue.SimpleQueue[RequestOutput | None]:
            q = self.loop.open_stream(rid)
            try:
                eng.add_request(list(request.prompt_token_ids), params, rid, stream_text=True,
                                lora=request.lora or None)
            except ValueError:
                self.loop.close_stream(rid)
                raise
            return q

        try:
            q = self.loop.call_sync(add)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        yield from self.stream_outputs(rid, q, context, min_chunk_tokens=request.min_chunk_tokens)

    def Session(self, request_iterator: Iterator[pb.SessionRequest],
                context: grpc.ServicerContext) -> Iterator[pb.SessionReply]:
        """Many ``Generate`` requests over one stream (see worker/session.py): a reader thread takes the router's
        messages, this handler thread writes the replies."""
        session = WorkerSession(self)
        context.add_callback(session.close)
        threading.Thread(target=session.read, args=(request_iterator,), name="session-reader", daemon=True).start()
        yield from session.replies()

    def stream_outputs(self, rid: str, q: queue.SimpleQueue[RequestOutput | None],
                       context: grpc.ServicerContext, min_chunk_tokens: int = 0,
                       skip_first: bool = False) -> Iterator[pb.TokenChunk]:
        """Relay a request's outputs; abort it on the engine if the client goes away. ``skip_first``: the caller
        already has the first token (``DecodeRequest.first_token_sent``), the stream starts at the second.

        One chunk per wake-up, not per step: outputs already queued behind the one that woke this thread (steps
        that ran while the client or this thread was slow) are merged into it, at no added latency. With
        ``min_chunk_tokens`` > 1 (a caller that does not stream to its own client) tokens are held until that
        many are ready or the request finished, so an 8-token answer is one message instead of eight. A skipped
        first token is not counted: every chunk but the last carries ``min_chunk_tokens`` of the stream's own.
        """
        context.add_callback(lambda: self.loop.call(lambda eng: self.abort_quietly(eng, rid)))
        batch: list[RequestOutput] = []
        held = -1 if skip_first else 0  # tokens this stream will send once the batch goes out
        sent = 0
        while True:
            out = self._next_output(q, rid, context)
            while out is not END:
                if out.finish_reason == "error":
                    context.abort(self.error_code(rid), out.new_text or f"request {rid} failed")
                batch.append(out)
                held += len(out.new_token_ids)
                if out.finished:
                    break
                try:
                    out = q.get_nowait()
                except queue.Empty:
                    if held >= min_chunk_tokens:
                        break
                    out = self._next_output(q, rid, context)
            if batch:
                chunk = chunk_from_outputs(batch, sent)
                if skip_first and not sent:
                    chunk = without_first_token(chunk, batch[0])
                    held += 1  # ``sent`` indexes the request's outputs, the skipped first token included
                if chunk.token_ids or chunk.finish_reason:
                    yield chunk
                sent += held
                batch.clear()
                held = 0
            if out is END:
                if self.loop.error is not None:
                    context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {self.loop.error}")
                return

    def _next_output(self, q: queue.SimpleQueue[RequestOutput | None], rid: str,
                     context: grpc.ServicerContext) -> RequestOutput | None:
        try:
            return q.get(timeout=self.request_timeout_s)
        except queue.Empty:
            self.loop.call(lambda eng: self.abort_quietly(eng, rid))
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} produced nothing for "
                          f"{self.request_timeout_s:.0f} s")
            raise  # pragma: no cover - abort raises

    def error_code(self, rid: str) -> grpc.StatusCode:
        """The status a request that ended in error gets: UNAVAILABLE (the worker's failure, e.g. a KV transfer:
        retried elsewhere), or FAILED_PRECONDITION when it stalled because its client read nothing (not retried)."""
        return grpc.StatusCode.FAILED_PRECONDITION if self.parking.is_stall(rid) else grpc.StatusCode.UNAVAILABLE

    def abort_quietly(self, eng: LLMEngine, rid: str) -> None:
        if rid in eng.scheduler.requests:
            for out in eng.abort([rid]):
                self.loop.publish(out)

    def _params(self, p: pb.SamplingParams, context: grpc.ServicerContext) -> Any:
        try:
            return params_from_proto(p)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # ---- control -------------------------------------------------------------------------------------------

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.loop.call_sync(self.abort_op(request.request_id)))

    def abort_op(self, rid: str) -> Callable[[LLMEngine], bool]:
        """The engine command behind ``Abort``: True if ``rid`` was found anywhere."""
        def abort(eng: LLMEngine) -> bool:
            found = self.abort_local(rid)
            if rid in eng.scheduler.requests:
                for out in eng.abort([rid]):
                    self.loop.publish(out)
                found = True
            return found

        return abort

    def abort_local(self, request_id: str) -> bool:
        """Role hook (loop thread): drop role-side state (transfers, holds) for ``request_id``."""
        return False

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        # Draining (SIGTERM, Drain, a dead rank) answers NOT_SERVING: a router stops sending before the process goes.
        status = "FAILED" if self.loop.error is not None else "NOT_SERVING" if self.draining else "SERVING"
        # The model's name, never its path: Health answers anyone who can reach the port.
        model = Path(self.engine.config.model).name
        return pb.HealthResponse(status=status, role=self.role, model=model,
                                 compat_hash=self.compat_hash, draining=self.draining, worker_id=self.worker_id,
                                 kv_backend=self.kv_backend, block_size=self.engine.block_size,
                                 hash_extra_keys=list(self.engine.extra_keys), session_port=self.session_port,
                                 lora_adapters=adapter_infos(self.engine))

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        return self.loop.call_sync(self._load)

    def _load(self, eng: LLMEngine) -> pb.LoadResponse:
        s = eng.scheduler
        # Prefill backlog: tokens still to compute (a decoding request contributes its one next token).
        active = sum(r.num_tokens - r.num_computed_tokens for r in s.running) + sum(r.num_tokens for r in s.waiting)
        parked = len(self.parking)
        return pb.LoadResponse(waiting=len(s.waiting), running=len(s.running) + parked, waiting_for_kv=len(s.remote),
                               active_tokens=active, free_blocks=eng.pool.num_free_blocks,
                               used_blocks=eng.pool.num_used_blocks, total_blocks=eng.pool.num_blocks,
                               kv_event_seq=eng.pool.event_seq, paused=parked,
                               generated_tokens=self.generated_tokens, **self.role_load(eng))

    def role_load(self, eng: LLMEngine) -> dict[str, int]:
        return {}

    def in_flight(self, eng: LLMEngine) -> int:
        """What a drained worker still waits for (loop thread): unfinished requests (parked ones included) and
        the role's pending work, such as prefill's KV transfers still streaming out."""
        return eng.scheduler.num_unfinished + len(self.parking) + self.role_in_flight()

    def role_in_flight(self) -> int:
        return 0

    def start_draining(self) -> None:
        """Refuse new work from now on and say so in the registry; in-flight work goes on."""
        self.draining = True
        if self.publisher is not None:
            self.publisher.set_draining()

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        self.start_draining()
        return pb.DrainResponse(in_flight=self.loop.call_sync(self.in_flight))

    # ---- KV events -----------------------------------------------------------------------------------------

    def _collect_events(self) -> None:
        batch = self.engine.take_kv_events()
        if batch is not None:
            if self.publisher is not None:
                self.publisher.publish(batch)
            with self._events_cv:
                self._events.append(batch)
                self._events_cv.notify_all()
                listeners = list(self.event_listeners)
            for wake in listeners:  # grpc.aio subscribers (worker/aio_service.py)
                wake()

    def KVEvents(self, request: pb.KVEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.KVEventBatch]:
        after = request.after_seq
        while context.is_active() and self.loop.error is None:
            with self._events_cv:
                ready = [b for b in self._events if b.seq > after]
                if not ready:
                    self._events_cv.wait(0.5)
                    continue
            for b in ready:
                yield pb.KVEventBatch(worker_id=self.worker_id, seq=b.seq, hashes=list(b.hashes), kinds=b.kinds)
                after = b.seq

    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> pb.SnapshotResponse:
        return self.loop.call_sync(self.snapshot_op)

    def snapshot_op(self, eng: LLMEngine) -> pb.SnapshotResponse:
        self._collect_events()  # everything up to now is in the ring, so seq matches the hashes
        return pb.SnapshotResponse(worker_id=self.worker_id, seq=eng.pool.event_seq, hashes=eng.pool.cached_hashes())

    def listen_events(self, wake: Callable[[], None], on: bool = True) -> None:
        """Have ``wake()`` called (on the loop thread) after each new event batch; ``on=False`` stops it."""
        with self._events_cv:
            if on:
                self.event_listeners.add(wake)
            else:
                self.event_listeners.discard(wake)

    def events_after(self, after: int) -> list[KVEventBatch]:
        """Ring entries after sequence number ``after`` (any thread)."""
        with self._events_cv:
            return [b for b in self._events if b.seq > after]

    def fail_request(self, eng: LLMEngine, request_id: str, message: str) -> None:
        """End a request with an explicit error (loop thread); its stream sees the message."""
        out = eng.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if out is not None:
            out.new_text = message
            self.loop.publish(out)
