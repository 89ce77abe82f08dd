"""The decode worker's gRPC face: ``Reserve`` and ``Decode`` over an engine whose KV connector is the decode role.

The request lifecycle (Prealloc → Transfer → Waiting → Running) and the landing KV are the connector's
(``decode_worker/connector.py``); this module turns RPCs into engine commands and replies: ``Reserve`` adds the
request (the engine reserves its blocks and the connector opens the receive), ``Decode`` hands over the first
token prefill sampled and streams the rest. ``--role both`` (colocated) serves ``Generate`` from the same engine.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from decode_worker.connector import DecodeConnector
from decode_worker.ranks import DecodeRanks, encode_destinations
from engine.engine_loop import OutputSink
from engine.llm_engine import LLMEngine
from engine.parallel.replica import ServedReplica
from kvtransfer.base import KVReceiver
from kvtransfer.layout import CompatibilityError, KVLayout
from proto.tandem.v1 import worker_pb2 as pb
from worker.convert import logprob_from_proto
from worker.lora_handoff import accept_lora, lora_ref, request_lora
from worker.service import WorkerService

T = TypeVar("T")


class DecodeService(WorkerService):
    role = "decode"

    def __init__(self, engine: LLMEngine, receiver: KVReceiver | None, layout: KVLayout, kv_backend: str,
                 worker_id: str | None = None, role: str = "decode", replica: ServedReplica | None = None) -> None:
        self.role = role
        super().__init__(engine, kv_backend, worker_id)
        self.receiver = receiver
        self.layout = layout
        self.connector: DecodeConnector | None = None
        if receiver is not None:
            wake = lambda: self.loop.call(_noop)  # noqa: E731
            ranks = DecodeRanks(replica, wake) if replica is not None else None  # the followers' receives
            self.connector = DecodeConnector(receiver, layout, wake=wake, ranks=ranks)
            engine.attach_connector(self.connector)

    @property
    def compat_hash(self) -> str:
        return self.layout.compat_hash()

    def stop(self) -> None:
        super().stop()
        if self.receiver is not None:
            self.receiver.close()

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        self._reject_if_draining(context)
        if self.connector is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV receiver")
        params = self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex
        try:
            resp = self._call(self.reserve_op(request, params, rid))
        except CompatibilityError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV handshake refused: {e}")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if resp is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough free KV blocks for this prompt")
        assert resp is not None  # context.abort raised otherwise
        return resp

    def reserve_op(self, request: pb.ReserveRequest, params: Any,
                   rid: str) -> Callable[[LLMEngine], pb.ReserveResponse | None]:
        """The engine command behind ``Reserve``: None if the blocks are not there, ValueError if refused."""
        lease_s = (request.lease_ms or 30_000) / 1000.0
        connector = self.connector
        assert connector is not None  # Reserve is refused without a receiver

        def reserve(eng: LLMEngine) -> pb.ReserveResponse | None:
            lora = accept_lora(eng, request_lora(request), "decode")  # LoRAMismatchError before any block
            req = eng.make_request(list(request.prompt_token_ids), params, rid, stream_text=True, lora=lora)
            connector.expect(rid, time.time() + lease_s)
            try:
                if not eng.add(req):
                    return None
            finally:
                connector.forget(rid)
            where = connector.destination(rid)
            assert where is not None  # the engine reserved the blocks and the connector opened the receive
            self.loop.open_stream(rid)
            # one destination per decode rank (a replica with TP ranks lands each rank's heads in that rank)
            return pb.ReserveResponse(destination=encode_destinations(connector.destinations(rid)),
                                      compat_hash=self.compat_hash, num_blocks=where[1], lora=lora_ref(eng, lora))

        return reserve

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        rid = request.request_id
        q = self._call(self.deliver_op(request, None))
        if isinstance(q, str):
            context.abort(self.refusal_code(rid), f"request {rid}: {q}")
        assert isinstance(q, queue.SimpleQueue)  # Reserve opened it with open_stream
        yield from self.stream_outputs(rid, q, context, min_chunk_tokens=request.min_chunk_tokens,
                                       skip_first=request.first_token_sent)

    def deliver_op(self, request: pb.DecodeRequest, sink: OutputSink | None) -> Callable[[LLMEngine], Any]:
        """The engine command behind ``Decode``: hand over the first token; the request's outputs go to ``sink``
        (None: the queue ``Reserve`` opened). Returns the sink, or why there is nothing to decode (a str). The
        engine's next step starts the request if its KV has landed."""
        rid = request.request_id
        first_lp = logprob_from_proto(request.first_logprob) if request.HasField("first_logprob") else None

        def deliver(eng: LLMEngine) -> Any:
            q = self.loop.stream(rid)
            if self.connector is None:
                return "this worker does not decode disaggregated requests"
            if q is None:
                return self.connector.failed.get(rid, "no reservation here (expired, aborted or never reserved)")
            refused = self.connector.deliver(rid, request.first_token_id, first_lp)
            if refused is not None:
                return refused
            if sink is not None:
                self.loop.attach(rid, sink)
                q = sink
            return q

        return deliver

    def refusal_code(self, rid: str) -> grpc.StatusCode:
        """A Decode with nothing to decode: NOT_FOUND, or UNAVAILABLE when its transfer failed here."""
        failed = self.connector is not None and rid in self.connector.failed
        return grpc.StatusCode.UNAVAILABLE if failed else grpc.StatusCode.NOT_FOUND

    def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        return self.loop.call(fn).result(30.0)

    def role_load(self, eng: LLMEngine) -> dict[str, int]:
        return {"transfers_in_flight": self.connector.in_transfer() if self.connector is not None else 0}


def _noop(_engine: LLMEngine) -> None:
    return None
