"""The prefill worker's gRPC face: ``Prefill`` over an engine whose KV connector is the prefill role.

The request lifecycle (Bootstrap → Waiting → Inflight → freed) and the transfer itself are the connector's
(``prefill_worker/connector.py``); this module turns RPCs into engine commands and replies. The first token goes
back as soon as the engine samples it, while the prompt's KV may still be streaming to decode.

Drain: an Inflight request has finished in the engine, yet its transfer is still work in flight. ``Drain`` counts
it (``role_in_flight``) and a SIGTERM drain waits for it, so a drained worker goes only once every transfer it
started ended DONE or FAILED.
"""

from __future__ import annotations

import dataclasses
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from engine.engine_loop import END, OutputSink
from engine.llm_engine import LLMEngine, RequestOutput
from engine.parallel.replica import ServedReplica
from kvtransfer.base import DestinationInfo, KVSender
from kvtransfer.layout import CompatibilityError, KVLayout
from prefill_worker.connector import PrefillConnector, TransferTiming
from prefill_worker.ranks import PrefillRanks
from proto.tandem.v1 import worker_pb2 as pb
from worker.convert import logprob_to_proto
from worker.lora_handoff import accept_lora, request_lora
from worker.service import WorkerService


class PrefillService(WorkerService):
    role = "prefill"
    refuse_colocated = "a prefill worker does not decode; use a decode or colocated (--role both) worker"

    def __init__(self, engine: LLMEngine, sender: KVSender, layout: KVLayout, kv_backend: str,
                 worker_id: str | None = None, replica: ServedReplica | None = None) -> None:
        super().__init__(engine, kv_backend, worker_id)
        self.sender = sender
        self.layout = layout
        wake = lambda: self.loop.call(_noop)  # noqa: E731
        ranks = PrefillRanks(replica, layout, wake) if replica is not None else None  # the followers' sends
        self.connector = PrefillConnector(sender, layout, wake=wake, ranks=ranks)
        engine.attach_connector(self.connector)

    @property
    def compat_hash(self) -> str:
        return self.layout.compat_hash()

    @property
    def timings(self) -> deque[TransferTiming]:
        """Finished transfers' timings, newest last (the overlap bench reads them)."""
        return self.connector.timings

    def stop(self) -> None:
        super().stop()
        self.sender.close()

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        self._reject_if_draining(context)
        params = self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex
        lease_s = (request.lease_ms or 30_000) / 1000.0
        try:
            dest = self.destination(request)
        except CompatibilityError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV handshake refused: {e}")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV destination: {e}")
        q: queue.SimpleQueue[RequestOutput | None] = queue.SimpleQueue()
        try:
            self.loop.call_sync(self.prefill_op(request, rid, params, dest, lease_s, q))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        out = q.get(timeout=lease_s + 60)
        if out is END or out is None or not out.token_ids:
            context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} did not complete")
        assert out is not None  # context.abort raised otherwise
        while q.get() is not END:
            pass
        return self.prefill_response(out)

    # ---- Prefill's parts, shared by the thread-per-call servicer above and worker/aio_service.py -------------

    def destination(self, request: pb.PrefillRequest) -> tuple[DestinationInfo, ...] | None:
        """The request's KV destination, checked against our layout and the request's LoRA adapter against ours
        (CompatibilityError, ValueError)."""
        if not request.destination:
            return None
        dest = self.connector.bootstrap.accept(request.destination)
        accept_lora(self.engine, request_lora(request), "prefill")  # reads the adapters' hashes: safe off the loop
        return dest

    def prefill_op(self, request: pb.PrefillRequest, rid: str, params: Any,
                   dest: tuple[DestinationInfo, ...] | None, lease_s: float,
                   sink: OutputSink) -> Callable[[LLMEngine], None]:
        """The engine command that starts a prefill: one token, its outputs to ``sink`` (ValueError if refused)."""
        one = dataclasses.replace(params, max_tokens=1, min_tokens=0, stop=(), logprobs=params.logprobs)
        lora = request.lora.name or None  # checked against the decode side's copy in ``destination``

        def add(eng: LLMEngine) -> None:
            self.loop.attach(rid, sink)
            try:
                eng.add_request(list(request.prompt_token_ids), one, rid, lora=lora)
            except ValueError:
                self.loop.detach(rid)
                raise
            if dest is not None:
                self.connector.expect(rid, dest, time.time() + lease_s)

        return add

    def prefill_response(self, out: RequestOutput) -> pb.PrefillResponse:
        resp = pb.PrefillResponse(first_token_id=out.token_ids[0], num_cached_tokens=out.num_cached_tokens,
                                  first_text=self.engine.tokenizer.decode(out.token_ids))
        if out.logprobs:
            resp.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        resp.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
        return resp

    # ---- role hooks of WorkerService (loop thread) -----------------------------------------------------------

    def abort_local(self, request_id: str) -> bool:
        return self.connector.cancel(request_id)

    def role_in_flight(self) -> int:
        """Transfers still streaming out of finished prefills: a drained worker waits for them."""
        return len(self.connector.inflight)

    def role_load(self, eng: LLMEngine) -> dict[str, int]:
        return self.connector.load()


def _noop(_engine: LLMEngine) -> None:
    return None
