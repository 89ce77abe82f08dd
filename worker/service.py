"""The gRPC service every worker role shares: colocated generation, abort, health, load, KV events, drain.

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
from collections.abc import Iterator
from typing import Any

import grpc

from engine.block_pool import KVEventBatch
from engine.engine_loop import END, EngineLoop
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import RequestStatus
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.convert import chunk_from_outputs, params_from_proto
from worker.session import WorkerSession

EVENT_RING = 4096


class WorkerService(pb_grpc.WorkerServicer):
    role = "both"
    refuse_colocated = ""  # why this role serves no colocated generation (Generate, Session), or ""
    session_port = 0  # the plain-TCP Session transport's port (worker/session.py SessionListener), 0 if none

    def __init__(self, engine: LLMEngine, kv_backend: str = "none", worker_id: str | None = None,
                 request_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.worker_id = worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.kv_backend = kv_backend
        self.request_timeout_s = request_timeout_s
        self.draining = False
        self._events: deque[KVEventBatch] = deque(maxlen=EVENT_RING)
        self._events_cv = threading.Condition()
        self.publisher: Any = None  # worker.redis_bus.RedisPublisher when a Redis URL is configured
        self.loop.add_hook(self._collect_events)

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
                eng.add_request(list(request.prompt_token_ids), params, rid, stream_text=True)
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
                       context: grpc.ServicerContext, min_chunk_tokens: int = 0) -> Iterator[pb.TokenChunk]:
        """Relay a request's outputs; abort it on the engine if the client goes away.

        One chunk per wake-up, not per step: outputs already queued behind the one that woke this thread (steps
        that ran while the client or this thread was slow) are merged into it, at no added latency. With
        ``min_chunk_tokens`` > 1 (a caller that does not stream to its own client) tokens are held until that
        many are ready or the request finished, so an 8-token answer is one message instead of eight.
        """
        context.add_callback(lambda: self.loop.call(lambda eng: self.abort_quietly(eng, rid)))
        batch: list[RequestOutput] = []
        held = 0
        sent = 0
        while True:
            out = self._next_output(q, rid, context)
            while out is not END:
                if out.finish_reason == "error":
                    context.abort(grpc.StatusCode.UNAVAILABLE, out.new_text or f"request {rid} failed")
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
                yield chunk_from_outputs(batch, sent)
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
        def abort(eng: LLMEngine) -> bool:
            found = self.abort_local(request.request_id)
            if request.request_id in eng.scheduler.requests:
                for out in eng.abort([request.request_id]):
                    self.loop.publish(out)
                found = True
            return found

        return pb.AbortResponse(found=self.loop.call_sync(abort))

    def abort_local(self, request_id: str) -> bool:
        """Role hook (loop thread): drop role-side state (transfers, holds) for ``request_id``."""
        return False

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        status = "SERVING" if self.loop.error is None else "FAILED"
        return pb.HealthResponse(status=status, role=self.role, model=self.engine.config.model,
                                 compat_hash=self.compat_hash, draining=self.draining, worker_id=self.worker_id,
                                 kv_backend=self.kv_backend, block_size=self.engine.block_size,
                                 hash_extra_keys=list(self.engine.extra_keys), session_port=self.session_port)

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        return self.loop.call_sync(self._load)

    def _load(self, eng: LLMEngine) -> pb.LoadResponse:
        s = eng.scheduler
        # Prefill backlog: tokens still to compute (a decoding request contributes its one next token).
        active = sum(r.num_tokens - r.num_computed_tokens for r in s.running) + sum(r.num_tokens for r in s.waiting)
        return pb.LoadResponse(waiting=len(s.waiting), running=len(s.running), waiting_for_kv=len(s.remote),
                               active_tokens=active, free_blocks=eng.pool.num_free_blocks,
                               used_blocks=eng.pool.num_used_blocks, total_blocks=eng.pool.num_blocks,
                               kv_event_seq=eng.pool.event_seq, **self.role_load(eng))

    def role_load(self, eng: LLMEngine) -> dict[str, int]:
        return {}

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        self.draining = True
        if self.publisher is not None:
            self.publisher.set_draining()
        return pb.DrainResponse(in_flight=self.loop.call_sync(lambda eng: eng.scheduler.num_unfinished))

    # ---- KV events -----------------------------------------------------------------------------------------

    def _collect_events(self) -> None:
        batch = self.engine.take_kv_events()
        if batch is not None:
            if self.publisher is not None:
                self.publisher.publish(batch)
            with self._events_cv:
                self._events.append(batch)
                self._events_cv.notify_all()

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
        def snap(eng: LLMEngine) -> pb.SnapshotResponse:
            self._collect_events()  # everything up to now is in the ring, so seq matches the hashes
            return pb.SnapshotResponse(worker_id=self.worker_id, seq=eng.pool.event_seq,
                                       hashes=eng.pool.cached_hashes())

        return self.loop.call_sync(snap)

    def fail_request(self, eng: LLMEngine, request_id: str, message: str) -> None:
        """End a request with an explicit error (loop thread); its stream sees the message."""
        out = eng.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        if out is not None:
            out.new_text = message
            self.loop.publish(out)
