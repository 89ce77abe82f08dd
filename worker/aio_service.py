"""The Worker gRPC API on ``grpc.aio``: what ``tandem worker`` serves.

Why not the thread-per-call server: every ``Decode``, ``Generate``, ``Session`` and ``KVEvents`` stream held one of
its 64 threads for its whole life, so a worker capped near 64 concurrent streams, and once they were all taken
``Health`` queued behind them: a busy worker answered no probe for seconds and the router cut it off, failing over
every request on it. Here a stream is a coroutine parked on its request's :class:`~worker.aio_stream.AioSink`,
and ``Health`` is answered on the event loop at once, whatever the engine is doing: it reads only fields the
engine loop never blocks (liveness never depends on the engine loop). The engine still runs on its own
thread; handlers send it commands (``EngineLoop.call``) and await their futures.

:class:`AioWorker` wraps a :class:`~worker.service.WorkerService` (any role) and uses its engine commands (the
``*_op`` methods), so both servers run the same logic; only the waiting differs. A gRPC ``Session`` runs the same
:class:`~worker.session.WorkerSession` as the plain-TCP session port: its messages are handed over on the loop,
its replies come from the session's reply thread, one at a time (a slow router holds that thread back, and the
replies behind it merge, as on the TCP port).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from engine.engine_loop import END
from engine.llm_engine import LLMEngine
from kvtransfer.layout import CompatibilityError
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.aio_stream import AioSink, LoopWaker
from worker.convert import chunk_from_outputs, params_from_proto
from worker.service import WorkerService, without_first_token
from worker.session import WorkerSession

if TYPE_CHECKING:
    from worker.tracing import WorkerTracer

log = logging.getLogger(__name__)
T = TypeVar("T")
COMMAND_TIMEOUT_S = 30.0  # an engine command (reserve, load, abort ...) that takes longer fails the call
MAX_UNSENT_TOKENS = 256  # a stream's tokens generated but not sent (its client is slow) before it is parked


class AioWorker(pb_grpc.WorkerServicer):
    def __init__(self, service: WorkerService, max_unsent_tokens: int = MAX_UNSENT_TOKENS,
                 tracer: WorkerTracer | None = None) -> None:
        if max_unsent_tokens < 1:
            raise ValueError(f"max_unsent_tokens must be >= 1, not {max_unsent_tokens}")
        self.svc = service
        self.max_unsent_tokens = max_unsent_tokens
        self.tracer = tracer  # --otlp-endpoint: spans of traced requests (worker/tracing.py)
        self._waker: LoopWaker | None = None  # shared by the sinks of the server's loop (worker/aio_stream.py)

    def _trace_parent(self, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """The router's trace context of this call, when tracing is on and the call carries one."""
        return None if self.tracer is None else self.tracer.parent(context.invocation_metadata())

    # ---- helpers -------------------------------------------------------------------------------------------

    async def _on_loop(self, fn: Callable[[LLMEngine], T], timeout_s: float = COMMAND_TIMEOUT_S) -> T:
        fut: concurrent.futures.Future[T] = self.svc.loop.call(fn)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    async def _refuse_if_draining(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self.svc.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.svc.worker_id} is draining")

    async def _params(self, p: pb.SamplingParams, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return params_from_proto(p)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _sink(self, rid: str, bounded: bool = True) -> AioSink:
        """A sink for ``rid``'s outputs; ``bounded``: park the request while its stream cannot send."""
        running = asyncio.get_running_loop()
        waker = self._waker
        if waker is None or waker.loop is not running:
            waker = self._waker = LoopWaker(running)
        if not bounded:
            return AioSink(waker)
        loop = self.svc.loop
        parking = self.svc.parking

        def caught_up() -> None:  # event loop: the stream sent its backlog
            loop.call(lambda eng: parking.resume(eng, rid))

        return AioSink(waker, self.max_unsent_tokens,
                       on_backlog=lambda: parking.want(rid),  # loop thread: takes effect at the next hook
                       on_caught_up=caught_up)

    async def _relay(self, rid: str, sink: AioSink, context: grpc.aio.ServicerContext[Any, Any],
                     min_chunk_tokens: int = 0, skip_first: bool = False) -> AsyncIterator[pb.TokenChunk]:
        """``WorkerService.stream_outputs`` on the event loop: one chunk per wake-up (everything queued since is
        merged into it), held until ``min_chunk_tokens`` are ready; the request is aborted on the engine if the
        stream ends before it does (client gone, deadline, error). ``skip_first``: the caller already sent the
        first token (``DecodeRequest.first_token_sent``); it is left out of the stream and of the count that
        pacing holds tokens for, so every chunk but the last still carries ``min_chunk_tokens``."""
        svc = self.svc
        timeout_s = svc.request_timeout_s
        batch: list[Any] = []
        held = -1 if skip_first else 0  # tokens this stream will send once the batch goes out
        sent = 0
        ended = False
        try:
            while True:
                out = await self._next(sink, rid, context, timeout_s)
                while out is not END:
                    if out.finish_reason == "error":
                        ended = True
                        await context.abort(svc.error_code(rid), out.new_text or f"request {rid} failed")
                    batch.append(out)
                    held += len(out.new_token_ids)
                    if out.finished:
                        ended = True
                        break
                    try:
                        out = sink.get_nowait()
                    except IndexError:
                        if held >= min_chunk_tokens:
                            break
                        out = await self._next(sink, rid, context, timeout_s)
                if batch:
                    chunk = chunk_from_outputs(batch, sent)
                    if skip_first and not sent:
                        chunk = without_first_token(chunk, batch[0])
                        held += 1  # ``sent`` indexes the request's outputs, the skipped first token included
                    sent += held
                    batch = []
                    held = 0
                    if chunk.token_ids or chunk.finish_reason:
                        yield chunk
                if out is END:
                    ended = True
                    if svc.loop.error is not None:
                        await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {svc.loop.error}")
                    return
        finally:
            if not ended:
                svc.loop.call(lambda eng: svc.abort_quietly(eng, rid))

    async def _next(self, sink: AioSink, rid: str, context: grpc.aio.ServicerContext[Any, Any],
                    timeout_s: float) -> Any:
        try:
            return await sink.get(timeout_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {rid} produced nothing for {timeout_s:.0f} s")

    # ---- generation ----------------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.TokenChunk]:
        svc = self.svc
        if svc.refuse_colocated:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, svc.refuse_colocated)
        await self._refuse_if_draining(context)
        params = await self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex
        sink = self._sink(rid)
        prompt = list(request.prompt_token_ids)
        lora = request.lora or None

        def add(eng: LLMEngine) -> None:
            svc.loop.attach(rid, sink)
            try:
                eng.add_request(prompt, params, rid, stream_text=True, lora=lora)
            except ValueError:
                svc.loop.detach(rid)
                raise

        try:
            await self._on_loop(add)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async for chunk in self._relay(rid, sink, context, request.min_chunk_tokens):
            yield chunk

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.SessionReply]:
        session = WorkerSession(self.svc)
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[pb.SessionReply | None] = asyncio.Queue(maxsize=2)

        gone = threading.Event()  # the handler returned: nobody takes replies any more

        def produce() -> None:  # the session's reply thread: one reply in hand at a time
            try:
                for reply in session.replies():
                    put = asyncio.run_coroutine_threadsafe(replies.put(reply), loop)
                    while not gone.is_set():
                        with contextlib.suppress(TimeoutError):
                            put.result(0.5)
                            break
                    else:
                        put.cancel()  # the rest of the session's replies are dropped as it ends
                if not gone.is_set():
                    asyncio.run_coroutine_threadsafe(replies.put(None), loop)
            except (RuntimeError, concurrent.futures.CancelledError):  # the server's loop is gone
                return

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    session.handle(msg)
            except (grpc.RpcError, asyncio.CancelledError):
                pass  # the stream broke: same as the router closing it
            finally:
                session.close()

        threading.Thread(target=produce, name="session-replies", daemon=True).start()
        reader = asyncio.create_task(read())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            gone.set()
            session.close()
            reader.cancel()

    async def Reserve(self, request: pb.ReserveRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pb.ReserveResponse:
        from worker.decode_service import DecodeService

        svc = self.svc
        await self._refuse_if_draining(context)
        if not isinstance(svc, DecodeService) or svc.connector is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV receiver")
        assert isinstance(svc, DecodeService)
        params = await self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex
        parent = self._trace_parent(context)
        try:
            resp = await self._on_loop(svc.reserve_op(request, params, rid))
        except CompatibilityError as e:  # the request's LoRA adapter differs from ours (worker/lora_handoff.py)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV handshake refused: {e}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if resp is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough free KV blocks for this prompt")
        assert resp is not None  # context.abort raised otherwise
        if parent is not None and self.tracer is not None:  # the landing ends on the engine loop (worker/tracing.py)
            self.tracer.hold(rid, parent, time.perf_counter())
        return resp

    async def Decode(self, request: pb.DecodeRequest,
                     context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.TokenChunk]:
        from worker.decode_service import DecodeService

        svc = self.svc
        rid = request.request_id
        if not isinstance(svc, DecodeService):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker does not decode")
        assert isinstance(svc, DecodeService)
        start, parent, sent = time.perf_counter(), self._trace_parent(context), 0
        sink = self._sink(rid)
        got = await self._on_loop(svc.deliver_op(request, sink))
        if isinstance(got, str):
            await context.abort(svc.refusal_code(rid), f"request {rid}: {got}")
        try:
            async for chunk in self._relay(rid, sink, context, request.min_chunk_tokens, request.first_token_sent):
                sent += len(chunk.token_ids)
                yield chunk
        finally:
            if parent is not None and self.tracer is not None:
                self.tracer.span("decode_worker.decode", parent, start, time.perf_counter(),
                                 {"tandem.request_id": rid, "tandem.tokens_sent": sent})

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pb.PrefillResponse:
        from worker.prefill_service import PrefillService

        svc = self.svc
        await self._refuse_if_draining(context)
        if not isinstance(svc, PrefillService):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker does not prefill")
        assert isinstance(svc, PrefillService)
        params = await self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex
        lease_s = (request.lease_ms or 30_000) / 1000.0
        start, parent = time.perf_counter(), self._trace_parent(context)
        try:
            dest = svc.destination(request)
        except CompatibilityError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV handshake refused: {e}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV destination: {e}")
        sink = self._sink(rid, bounded=False)
        if parent is not None and self.tracer is not None and dest is not None:
            self.tracer.hold(rid, parent)  # its transfer's span ends when the transport reports it (engine loop)
        try:
            await self._on_loop(svc.prefill_op(request, rid, params, dest, lease_s, sink))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finished = False
        try:
            out = await sink.get(lease_s + 60)
            if out is END or not out.token_ids:
                await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} did not complete")
            while await sink.get(lease_s + 60) is not END:
                pass
            finished = True
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} did not complete in time")
        finally:
            if not finished:  # the caller went away (or the wait failed): the prefill and its transfer stop
                svc.loop.call(svc.abort_op(rid))
        assert out is not None  # context.abort raised otherwise
        if parent is not None and self.tracer is not None:
            self.tracer.span("prefill_worker.prefill", parent, start, time.perf_counter(),
                             {"tandem.request_id": rid, "tandem.prompt_tokens": len(request.prompt_token_ids),
                              "tandem.cached_tokens": out.num_cached_tokens})
        return svc.prefill_response(out)

    # ---- control -------------------------------------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self._on_loop(self.svc.abort_op(request.request_id)))

    async def Health(self, request: pb.HealthRequest,
                     context: grpc.aio.ServicerContext[Any, Any]) -> pb.HealthResponse:
        return self.svc.Health(request, context)  # type: ignore[arg-type]  # reads fields only: never blocks

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.LoadResponse:
        return await self._on_loop(self.svc._load)

    async def Drain(self, request: pb.DrainRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> pb.DrainResponse:
        self.svc.start_draining()
        return pb.DrainResponse(in_flight=await self._on_loop(self.svc.in_flight))

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext[Any, Any]) -> pb.LoRAAdaptersResponse:
        """Serve a LoRA adapter from now on (worker/lora_admin.py); the registry entry follows at once."""
        from worker.lora_admin import AdaptersRefused, load_op

        try:
            infos = await self._on_loop(load_op(self.svc, request.name, request.path), timeout_s=300.0)
        except AdaptersRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self._adapters_changed(infos)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext[Any, Any]) -> pb.LoRAAdaptersResponse:
        """Stop serving a LoRA adapter; refused while unfinished requests name it (worker/lora_admin.py)."""
        from engine.lora.manager import UnknownAdapterError
        from worker.lora_admin import AdapterInUse, AdaptersRefused, unload_op

        try:
            infos = await self._on_loop(unload_op(self.svc, request.name))
        except (AdaptersRefused, AdapterInUse) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except UnknownAdapterError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return self._adapters_changed(infos)

    def _adapters_changed(self, infos: list[pb.LoRAAdapterInfo]) -> pb.LoRAAdaptersResponse:
        publisher = self.svc.publisher
        if publisher is not None:
            publisher.set_loras({a.name: a.content_hash for a in infos})
        return pb.LoRAAdaptersResponse(adapters=infos)

    async def Snapshot(self, request: pb.SnapshotRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> pb.SnapshotResponse:
        return await self._on_loop(self.svc.snapshot_op)

    async def KVEvents(self, request: pb.KVEventsRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.KVEventBatch]:
        svc = self.svc
        loop = asyncio.get_running_loop()
        fresh = asyncio.Event()

        def wake() -> None:  # loop thread, after each new batch
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fresh.set)

        svc.listen_events(wake)
        after = request.after_seq
        try:
            while svc.loop.error is None:
                fresh.clear()
                ready = svc.events_after(after)
                if not ready:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.5):
                            await fresh.wait()
                    continue
                for b in ready:
                    yield pb.KVEventBatch(worker_id=svc.worker_id, seq=b.seq, hashes=list(b.hashes), kinds=b.kinds)
                    after = b.seq
        finally:
            svc.listen_events(wake, False)
