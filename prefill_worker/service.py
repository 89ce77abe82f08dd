"""Prefill worker. Request lifecycle, as queues::

    Bootstrap ──► Waiting ──► Inflight ──► (transfer DONE | FAILED) ──► freed
    (destination   (engine      (prefill done: first token returned to the caller at once;
     checked)       schedules,   blocks held, layers still streaming to decode)
                    chunked)

- **Bootstrap**: ``Prefill`` arrives with decode's serialised destination. Its layout is checked against ours
  (model, dtype, block size, head geometry, layout) before any work; a mismatch is refused with the field named.
- **Waiting**: the request is an ordinary engine request generating one token, so it batches and chunks with
  everything else and reuses the prefix cache.
- **Inflight**: in the step that computes the prompt's last chunk, the transfer starts at layer 0 and each
  layer is handed to the sender the moment that layer's forward finishes, so the transfer overlaps the remaining
  layers. At the last layer the prompt's blocks get an extra reference (the hold) so that finishing the engine
  request does not free blocks the sender still reads. The first token goes back to the caller immediately:
  TTFT never waits on the transfer. The hold is dropped when the sender reports DONE or FAILED (peer death, lease
  expiry): every path frees the blocks. The sender wakes the engine loop the moment a transfer is DONE (that moment
  ends the request's ``TransferTiming``), so an idle loop frees the hold then, not at its next idle tick.

Drain: an Inflight request has finished in the engine, yet its transfer is still work in flight. ``Drain`` counts
it (``role_in_flight``) and a SIGTERM drain waits for it, so a drained worker goes only once every transfer it
started ended DONE or FAILED.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine.block_pool import KVBlock
from engine.engine_loop import END, OutputSink
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import Request
from kvtransfer.base import DestinationInfo, KVSender, TransferState
from kvtransfer.layout import CompatibilityError, KVLayout
from proto.tandem.v1 import worker_pb2 as pb
from worker.convert import logprob_to_proto
from worker.service import WorkerService

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Bootstrap:
    """A request whose destination was accepted; it waits in the engine until its final prefill step."""

    dest: DestinationInfo
    deadline_s: float
    started: bool = False


@dataclass(slots=True)
class Inflight:
    """Prefill done; blocks held until the transfer finishes either way."""

    held: list[KVBlock]
    deadline_s: float
    compute_done: float  # perf_counter when the last layer's forward finished


@dataclass(slots=True, frozen=True)
class TransferTiming:
    """How long a finished transfer outlived the compute it overlapped (for metrics and the overlap bench)."""

    request_id: str
    compute_done: float
    transfer_done: float
    ok: bool

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.transfer_done - self.compute_done)


class PrefillService(WorkerService):
    role = "prefill"
    refuse_colocated = "a prefill worker does not decode; use a decode or colocated (--role both) worker"

    def __init__(self, engine: LLMEngine, sender: KVSender, layout: KVLayout, kv_backend: str,
                 worker_id: str | None = None) -> None:
        super().__init__(engine, kv_backend, worker_id)
        self.sender = sender
        self.layout = layout
        self.bootstrap: dict[str, Bootstrap] = {}
        self.inflight: dict[str, Inflight] = {}
        self._step_sends: list[Request] = []
        self._step_seen: object = None
        self.stall: tuple[int, float] | None = None  # fault injection: (layer, seconds)
        # Fault injection: each transfer's last layer (and so its end) goes out this long after the prefill
        # finished, while the first token has already gone back to the caller.
        self.transfer_delay_s = 0.0
        self._delayed: deque[tuple[float, str, int]] = deque()
        self.timings: deque[TransferTiming] = deque(maxlen=1024)
        self.transfer_totals = {"kv_transfers_done": 0, "kv_transfers_failed": 0, "kv_transfer_bytes": 0,
                                "kv_transfer_exposed_us": 0}  # since start, reported in Load (loop thread)
        self._done_at: dict[str, float] = {}  # perf_counter when the sender reported DONE (written on its thread)
        self.loop.after_layer = self._after_layer
        self.loop.add_hook(self._poll_transfers)
        sender.set_on_done(self._on_transfer_done)

    @property
    def compat_hash(self) -> str:
        return self.layout.compat_hash()

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

    def destination(self, request: pb.PrefillRequest) -> DestinationInfo | None:
        """The request's KV destination, checked against our layout (CompatibilityError, ValueError)."""
        if not request.destination:
            return None
        dest = DestinationInfo.from_bytes(request.destination)
        self.layout.check_compatible(dest.layout)
        return dest

    def prefill_op(self, request: pb.PrefillRequest, rid: str, params: Any, dest: DestinationInfo | None,
                   lease_s: float, sink: OutputSink) -> Callable[[LLMEngine], None]:
        """The engine command that starts a prefill: one token, its outputs to ``sink`` (ValueError if refused)."""
        one = dataclasses.replace(params, max_tokens=1, min_tokens=0, stop=(), logprobs=params.logprobs)

        def add(eng: LLMEngine) -> None:
            self.loop.attach(rid, sink)
            try:
                eng.add_request(list(request.prompt_token_ids), one, rid)
            except ValueError:
                self.loop.detach(rid)
                raise
            if dest is not None:
                self.bootstrap[rid] = Bootstrap(dest, time.time() + lease_s)

        return add

    def prefill_response(self, out: RequestOutput) -> pb.PrefillResponse:
        resp = pb.PrefillResponse(first_token_id=out.token_ids[0], num_cached_tokens=out.num_cached_tokens,
                                  first_text=self.engine.tokenizer.decode(out.token_ids))
        if out.logprobs:
            resp.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        resp.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
        return resp

    # ---- the transfer, on the engine loop thread -----------------------------------------------------------

    def _after_layer(self, layer: int) -> None:
        step = self.engine.current_step
        if step is not self._step_seen:
            self._step_seen = step
            self._step_sends = []
            if step is not None and self.bootstrap:
                for req, n in zip(step.requests, step.num_new_tokens, strict=True):
                    if req.num_computed_tokens + n == req.num_tokens and req.request_id in self.bootstrap:
                        self._step_sends.append(req)
        if not self._step_sends:
            return
        last = layer == self.engine.model_config.num_layers - 1
        delay = last and self.transfer_delay_s > 0
        for req in list(self._step_sends):
            rid = req.request_id
            boot = self.bootstrap.get(rid)
            if boot is None:
                continue
            try:
                if not boot.started:
                    nblocks = -(-req.num_prompt_tokens // self.engine.block_size)
                    src = self.engine.kv.block_ids(rid)[:nblocks]
                    self.sender.start(rid, boot.dest, src, boot.deadline_s)
                    boot.started = True
                if not delay:
                    self.sender.send_layer(rid, layer)
                if self.stall is not None and layer == self.stall[0]:
                    log.warning("fault injection: stalling %.1fs after layer %d of %s", self.stall[1], layer, rid)
                    time.sleep(self.stall[1])
                if last:
                    if delay:  # fault injection: the last layer and the transfer's end go out later
                        self._delayed.append((time.monotonic() + self.transfer_delay_s, rid, layer))
                    else:
                        self.sender.finish(rid)
                    nblocks = -(-req.num_prompt_tokens // self.engine.block_size)
                    held = self.engine.kv.block_tables[rid][:nblocks]
                    self.engine.pool.touch(held)
                    self.inflight[rid] = Inflight(list(held), boot.deadline_s, time.perf_counter())
                    del self.bootstrap[rid]
            except Exception as e:  # a broken transfer must not take the engine down
                log.warning("transfer of %s failed to start: %s", rid, e)
                self.bootstrap.pop(rid, None)
                self.sender.release(rid)
                self._step_sends.remove(req)

    def _on_transfer_done(self, request_id: str) -> None:
        # Sender thread: note the moment (the timing's end), then queue an empty command; the loop runs its hooks
        # (``_poll_transfers``) right after it.
        if request_id in self.inflight or request_id in self.bootstrap:
            self._done_at[request_id] = time.perf_counter()
        self.loop.call(_noop)

    def _send_delayed(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, rid, layer = self._delayed.popleft()
            if rid in self.inflight:
                try:
                    self.sender.send_layer(rid, layer)
                    self.sender.finish(rid)
                except Exception as e:  # as in _after_layer: the transfer fails, the engine goes on
                    log.warning("delayed transfer of %s failed: %s", rid, e)

    def _poll_transfers(self) -> None:
        if self._delayed:
            self._send_delayed()
        now = time.time()
        for rid in list(self.inflight):
            st = self.sender.poll(rid)
            expired = now > self.inflight[rid].deadline_s + 1.0
            if st.state >= TransferState.DONE or expired:
                ok = st.state == TransferState.DONE
                if not ok:
                    log.info("KV transfer of %s failed: %s", rid, st.error or "lease expired")
                done_at = self._done_at.pop(rid, None)
                end = done_at if ok and done_at is not None else time.perf_counter()
                self.timings.append(TransferTiming(rid, self.inflight[rid].compute_done, end, ok))
                totals = self.transfer_totals
                totals["kv_transfers_done" if ok else "kv_transfers_failed"] += 1
                totals["kv_transfer_bytes"] += st.bytes_sent
                if ok:
                    totals["kv_transfer_exposed_us"] += int(1e6 * max(0.0, end - self.inflight[rid].compute_done))
                self._drop(rid)
        # A request that never reached its final prefill step (aborted, or finished early) releases its lease.
        for rid in list(self.bootstrap):
            if rid not in self.engine.scheduler.requests:
                del self.bootstrap[rid]
                self.sender.release(rid)

    def _drop(self, rid: str) -> None:
        self._done_at.pop(rid, None)
        infl = self.inflight.pop(rid, None)
        if infl is not None:
            self.engine.pool.free_blocks(reversed(infl.held))
        self.sender.release(rid)

    def abort_local(self, request_id: str) -> bool:
        found = request_id in self.inflight or request_id in self.bootstrap
        self.bootstrap.pop(request_id, None)
        self._drop(request_id)
        return found

    def role_in_flight(self) -> int:
        """Transfers still streaming out of finished prefills: a drained worker waits for them (loop thread)."""
        return len(self.inflight)

    def role_load(self, eng: LLMEngine) -> dict[str, int]:
        return {"transfers_in_flight": len(self.inflight),
                "held_blocks": sum(len(i.held) for i in self.inflight.values()), **self.transfer_totals}


def _noop(_engine: LLMEngine) -> None:
    return None
