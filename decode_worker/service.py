"""Decode worker. Request lifecycle, as queues::

    Prealloc ──► Transfer ──► Waiting ──► Running ──► finished
    (Reserve:    (KV landing   (KV landed,   (continuous batching
     blocks       layer by      waiting for   with every other
     reserved)    layer)        first token)  request)

- **Prealloc**: ``Reserve`` allocates blocks for the whole prompt up front (``WAITING_FOR_REMOTE_KV`` in the
  engine) and opens a receive lease on them; the reply carries the destination and our compatibility hash. No
  blocks → RESOURCE_EXHAUSTED, so the caller can pick another decode worker before any prefill work is done.
- **Transfer**: the receiver reports progress; prefill death, lease expiry or a refused handshake become an
  explicit FAILED with a message, which ends the request, frees its blocks and reaches the caller's stream.
- **Waiting**: decode can start only when both the last layer has landed and ``Decode`` has delivered the first
  token (sampled by prefill). Whichever comes second moves the request to Running. A request whose first token
  does not arrive within its lease is failed and freed.
- **Running**: an ordinary engine request; the next token is computed from the received KV.

While the only requests are in Prealloc/Transfer the engine has nothing to compute, yet it counts them as
unfinished, so the engine loop would step an empty schedule back to back: a whole core and the GIL, taken from the
NIXL/UCX threads that land the bytes and from the receiver's notification thread (measured on 2 cores: the last
layer's notification reached the receiver ~11 ms after the sender saw its WRITE complete, and the ACK took up to
18 ms more, against well under 1 ms each with the loop quiet). The transfer hook therefore blocks until the loop
gets a command, up to ``REMOTE_ONLY_WAIT_S``: every RPC of this service and a finished transfer (the receiver's
``on_done`` queues a no-op) are commands, so only a failure or an expired lease is noticed by that backstop tick.
A 2 ms tick here cost ~5 ms of decode CPU per 1k-token transfer (500 empty passes a second).

``--role both`` (colocated) serves ``Generate`` from the same engine.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from engine.engine_loop import OutputSink
from engine.llm_engine import LLMEngine
from engine.request import TokenLogprobs
from kvtransfer.base import KVReceiver, TransferState
from kvtransfer.layout import KVLayout
from proto.tandem.v1 import worker_pb2 as pb
from worker.convert import logprob_from_proto
from worker.service import WorkerService

log = logging.getLogger(__name__)
T = TypeVar("T")
REMOTE_ONLY_WAIT_S = 0.05  # the hook's backstop while only transfers are pending: how late a failure may be seen


@dataclass(slots=True)
class Pending:
    """A reserved request in Transfer or Waiting."""

    deadline_s: float
    kv_done: bool = False
    first_token: int | None = None
    first_logprob: TokenLogprobs | None = None


class DecodeService(WorkerService):
    role = "decode"

    def __init__(self, engine: LLMEngine, receiver: KVReceiver | None, layout: KVLayout, kv_backend: str,
                 worker_id: str | None = None, role: str = "decode") -> None:
        self.role = role
        super().__init__(engine, kv_backend, worker_id)
        self.receiver = receiver
        self.layout = layout
        self.pending: dict[str, Pending] = {}
        self.failed: OrderedDict[str, str] = OrderedDict()  # why recent requests failed, for late Decode calls
        self.loop.add_hook(self._poll_transfers)
        if receiver is not None:
            receiver.set_on_done(self._on_transfer_done)

    @property
    def compat_hash(self) -> str:
        return self.layout.compat_hash()

    def stop(self) -> None:
        super().stop()
        if self.receiver is not None:
            self.receiver.close()

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        self._reject_if_draining(context)
        if self.receiver is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no KV receiver")
        receiver = self.receiver
        assert receiver is not None  # context.abort raised otherwise
        params = self._params(request.params, context)
        rid = request.request_id or uuid.uuid4().hex
        try:
            resp = self._call(self.reserve_op(request, params, rid, receiver))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if resp is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough free KV blocks for this prompt")
        assert resp is not None  # context.abort raised otherwise
        return resp

    def reserve_op(self, request: pb.ReserveRequest, params: Any, rid: str,
                   receiver: KVReceiver) -> Callable[[LLMEngine], pb.ReserveResponse | None]:
        """The engine command behind ``Reserve``: None if the blocks are not there, ValueError if refused."""
        lease_s = (request.lease_ms or 30_000) / 1000.0

        def reserve(eng: LLMEngine) -> pb.ReserveResponse | None:
            req = eng.make_request(list(request.prompt_token_ids), params, rid, stream_text=True)
            block_ids = eng.reserve_remote(req)
            if block_ids is None:
                return None
            deadline = time.time() + lease_s
            try:
                dest = receiver.reserve(rid, block_ids, req.num_prompt_tokens, deadline)
            except Exception:
                eng.abort([rid])
                raise
            self.loop.open_stream(rid)
            self.pending[rid] = Pending(deadline)
            return pb.ReserveResponse(destination=dest.to_bytes(), compat_hash=self.compat_hash,
                                      num_blocks=len(block_ids))

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
        (None: the queue ``Reserve`` opened). Returns the sink, or why there is nothing to decode (a str)."""
        rid = request.request_id
        first_lp = logprob_from_proto(request.first_logprob) if request.HasField("first_logprob") else None

        def deliver(eng: LLMEngine) -> Any:
            p = self.pending.get(rid)
            q = self.loop.stream(rid)
            if p is None or q is None or p.first_token is not None:  # a second Decode for one reservation too
                return self.failed.get(rid, "no reservation here (expired, aborted or never reserved)")
            if sink is not None:
                self.loop.attach(rid, sink)
                q = sink
            p.first_token, p.first_logprob = request.first_token_id, first_lp
            if p.kv_done:
                self._start(eng, rid)
            return q

        return deliver

    def refusal_code(self, rid: str) -> grpc.StatusCode:
        """A Decode with nothing to decode: NOT_FOUND, or UNAVAILABLE when its transfer failed here."""
        return grpc.StatusCode.NOT_FOUND if rid not in self.failed else grpc.StatusCode.UNAVAILABLE

    def _start(self, eng: LLMEngine, rid: str) -> None:
        p = self.pending.pop(rid)
        assert p.first_token is not None
        self.loop.publish(eng.start_remote_decode(rid, p.first_token, p.first_logprob))

    def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        return self.loop.call(fn).result(30.0)

    def _on_transfer_done(self, _request_id: str) -> None:
        # Receiver thread: only signal. A queued no-op ends the transfer hook's wait (and an idle loop's).
        self.loop.call(_noop)

    def _wait_while_only_transfers(self) -> None:
        sch = self.engine.scheduler
        if sch.remote and not sch.waiting and not sch.running:
            self.loop.wait_for_command(REMOTE_ONLY_WAIT_S)

    def _poll_transfers(self) -> None:
        if not self.pending or self.receiver is None:
            return
        self._wait_while_only_transfers()
        eng = self.engine
        now = time.time()
        for rid, p in list(self.pending.items()):
            if not p.kv_done:
                st = self.receiver.poll(rid)
                if st.state == TransferState.DONE:
                    p.kv_done = True
                    self.receiver.release(rid)
                elif st.state == TransferState.FAILED:
                    self._fail(eng, rid, f"KV transfer failed: {st.error}")
                    continue
                elif now > p.deadline_s + 1.0:
                    self._fail(eng, rid, "KV transfer lease expired")
                    continue
            if p.kv_done:
                if p.first_token is not None:
                    self._start(eng, rid)
                elif now > p.deadline_s:
                    self._fail(eng, rid, "no Decode call arrived within the lease")

    def _fail(self, eng: LLMEngine, rid: str, message: str) -> None:
        log.info("request %s failed: %s", rid, message)
        self.pending.pop(rid, None)
        if self.receiver is not None:
            self.receiver.release(rid)
        self.failed[rid] = message
        while len(self.failed) > 1024:
            self.failed.popitem(last=False)
        self.fail_request(eng, rid, message)

    def abort_local(self, request_id: str) -> bool:
        p = self.pending.pop(request_id, None)
        if p is not None and self.receiver is not None:
            self.receiver.release(request_id)
        return p is not None

    def role_load(self, eng: LLMEngine) -> dict[str, int]:
        return {"transfers_in_flight": sum(1 for p in self.pending.values() if not p.kv_done)}


def _noop(_engine: LLMEngine) -> None:
    return None
