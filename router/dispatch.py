"""Running one request on the workers: choose where, run it, and survive worker failures.

Per choice (``n`` > 1 fans out into independent choices):

1. **Decide** colocated vs disaggregated. The best decode worker is chosen first (KV overlap and load). If the
   part of the prompt it does not already cache is shorter than ``DisaggConfig.min_uncached_tokens``, or no
   prefill worker is up, the request runs colocated there (``Generate``): a short or mostly cached prompt costs
   less to prefill in place than to ship. Otherwise the cheapest prefill worker computes it and streams the KV
   into the decode worker (Reserve → Prefill → Decode). Every decision carries its reason and cost breakdown.
   Prefill's first token is yielded the moment ``Prefill`` returns, and decode's stream continues from the second
   (``DecodeRequest.first_token_sent``): TTFT never waits on the KV transfer. ``Decode`` travels the decode
   worker's ``Session`` stream (router/session.py), batched per engine step with every other request on it; a
   request whose trace context must travel as gRPC metadata uses the ``Decode`` call instead.
2. **Retry**: a failure before the first token (worker down, overloaded, lease expired) excludes that worker and
   tries again on another, with bounded attempts and exponential backoff.
3. **Migrate**: if the decode worker dies mid-stream, the prompt plus every token generated so far is resubmitted
   to a new pair with the remaining budget. The client's stream continues: no token is repeated or lost (exact
   for greedy decoding; a sampled continuation is drawn afresh).
4. **Cancel**: if the client goes away, the request is aborted on every worker it touched, freeing its blocks.

A request of a LoRA adapter (``lora``) has its candidates narrowed to the workers that serve it: decode workers that
list it, and prefill workers that list the same content (hash) as the chosen decode worker, so it is disaggregated
only where both sides apply the same adapter (the hand-off carries it as a ``LoRARef`` that both workers check:
worker/lora_handoff.py; a decode worker that does not echo it in ``ReserveResponse.lora`` does not apply adapters,
and the attempt fails rather than decode without it). Each choice hashes the prompt with the adapter in the block
hash's extra keys (prefixes cached under that adapter) and adds the adapter term to the cost (router/cost.py: a
worker holding the adapter loaded wins over one that must read it from disk, unless it is busier by more than that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from proto.tandem.v1 import worker_pb2 as pb
from router.pool import Worker, WorkerPool
from router.session import SessionError, WorkerSession

log = logging.getLogger(__name__)
Metadata = tuple[tuple[str, str], ...]  # gRPC call metadata (the request's trace context)

_LINGER_S = 1.0  # how long a finished stream may take to deliver its status before it is cancelled
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class Decision(Protocol):
    worker_id: str
    overlap_blocks: int
    request_blocks: int


class Selector(Protocol):
    block_size: int

    def select(self, token_ids: Sequence[int], workers: Sequence[str], lora: str | None = None,
               holders: Sequence[str] = ()) -> Any: ...
    def release(self, decision: Any) -> None: ...


@dataclass(slots=True, frozen=True)
class DisaggConfig:
    min_uncached_tokens: int = 64
    max_attempts: int = 3
    backoff_s: float = 0.05
    lease_ms: int = 30_000
    rpc_timeout_s: float = 300.0
    # A streamed request's tokens waiting for its client before the worker pauses it (router/session.py, _paced)
    max_buffered_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_buffered_tokens < 1:
            raise ValueError(f"max_buffered_tokens must be >= 1, got {self.max_buffered_tokens}")
        if self.min_uncached_tokens < 0:
            raise ValueError(f"min_uncached_tokens must be >= 0, got {self.min_uncached_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


class DispatchError(Exception):
    """A request that could not be served; ``status`` is the HTTP status the gateway should answer."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(slots=True)
class Plan:
    mode: str  # "colocated" | "disaggregated"
    reason: str
    decode: Worker
    prefill: Worker | None = None
    decode_decision: Any = None
    prefill_decision: Any = None
    lora: str = ""  # the request's LoRA adapter (empty: the base model)

    @property
    def breakdown(self) -> str:
        """The chosen workers' cost breakdowns, formatted on demand (the explain header, debug logging)."""
        if self.decode_decision is None:
            return ""
        if self.prefill_decision is None:
            return _header(self.decode_decision)
        return f"prefill[{_header(self.prefill_decision)}];decode[{_header(self.decode_decision)}]"


@dataclass(slots=True)
class DispatchStats:
    decisions: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    migrations: int = 0


class _WorkerFailed(Exception):
    def __init__(self, worker: Worker, step: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{step} on {worker.worker_id or worker.address} failed ({code.name}): {details}")
        self.worker = worker
        self.step = step
        self.code = code
        self.details = details


class Dispatcher:
    def __init__(self, pool: WorkerPool, prefill_selector: Selector, decode_selector: Selector,
                 config: DisaggConfig | None = None, on_decision: Any = None) -> None:
        self.pool = pool
        self.prefill_selector = prefill_selector
        self.decode_selector = decode_selector
        self.config = config or DisaggConfig()
        self.on_decision = on_decision
        self.stats = DispatchStats()
        self._background: set[asyncio.Future[None]] = set()

    def plan(self, prompt: list[int], exclude: set[str], lora: str = "") -> Plan:
        decoders = [w for w in self.pool.available("decode") if w.address not in exclude]
        if not decoders:
            raise DispatchError(503, "no decode worker is available", retry_after=1.0)
        if lora:
            decoders = [w for w in decoders if lora in w.loras]
            if not decoders:
                raise DispatchError(503, f"no available worker serves the LoRA adapter {lora!r} now",
                                    retry_after=1.0)
        by_id = {w.worker_id: w for w in decoders}
        d = _select(self.decode_selector, prompt, decoders, lora)
        decode = by_id[d.worker_id]
        bs = self.decode_selector.block_size
        uncached = len(prompt) - d.overlap_blocks * bs
        prefillers = [w for w in self.pool.available("prefill") if w.address not in exclude]
        if lora:  # the same adapter files as the decode worker's (the hand-off checks it too)
            prefillers = [w for w in prefillers if w.loras.get(lora) == decode.loras[lora]]
        if not prefillers:
            return self._decided(Plan("colocated", "no_prefill_worker", decode, decode_decision=d, lora=lora))
        if uncached < self.config.min_uncached_tokens:
            reason = "prefix_hit_on_decode" if d.overlap_blocks else "short_prompt"
            return self._decided(Plan("colocated", reason, decode, decode_decision=d, lora=lora))
        by_pid = {w.worker_id: w for w in prefillers}
        p = _select(self.prefill_selector, prompt, prefillers, lora)
        return self._decided(Plan("disaggregated", "long_uncached_prompt", decode, by_pid[p.worker_id],
                                  decode_decision=d, prefill_decision=p, lora=lora))

    def _decided(self, plan: Plan) -> Plan:
        self.stats.decisions[plan.reason] = self.stats.decisions.get(plan.reason, 0) + 1
        if self.on_decision is not None:
            self.on_decision(plan)
        if log.isEnabledFor(logging.DEBUG):  # the breakdown is formatted only when it is logged
            log.debug("route %s via %s: %s", plan.mode, plan.reason, plan.breakdown)
        return plan

    def _release(self, plan: Plan) -> None:
        if plan.decode_decision is not None:
            self.decode_selector.release(plan.decode_decision)
        if plan.prefill_decision is not None:
            self.prefill_selector.release(plan.prefill_decision)

    async def run(self, request_id: str, prompt: list[int], params: pb.SamplingParams,
                  plan_out: list[Plan] | None = None, min_chunk_tokens: int = 0,
                  trace: Metadata = (), lora: str = "") -> AsyncGenerator[pb.TokenChunk, None]:
        """Yield the request's chunks, retrying and migrating across workers as needed.

        ``min_chunk_tokens`` > 1 lets the workers hold tokens until that many are ready (worker.proto's output
        pacing), for a caller that answers its client only at the end: fewer messages, and a migration loses at
        most that many tokens of decode work (never tokens already yielded here). ``trace``: gRPC metadata
        carrying the request's W3C trace context to the disaggregated calls (router/tracing.py; empty: none).
        ``lora``: the LoRA adapter the request runs under (empty: the base model).
        """
        generated: list[int] = []
        exclude: set[str] = set()
        attempt = 0
        while True:
            plan, rid, full, cont = self._next_attempt(request_id, attempt, prompt, params, generated, exclude,
                                                       plan_out, lora)
            if plan.mode == "colocated":
                # On the worker's session; a request that stops early is aborted through it (WorkerSession).
                session = plan.decode.session
                assert session is not None
                source = session.generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=full, params=cont,
                                                             min_chunk_tokens=min_chunk_tokens, lora=lora),
                                          self.config.rpc_timeout_s, self.config.max_buffered_tokens)
            else:
                source = self._disaggregated_run(plan, rid, full, cont, min_chunk_tokens, trace)
            try:
                # Closed in ``finally`` (aclosing below): an inner generator ends as soon as its consumer stops, not
                # later by the event loop's async-generator finalizer (a task and a self-pipe wake-up each).
                try:
                    async for chunk in source:
                        generated.extend(chunk.token_ids)
                        yield chunk
                        if chunk.finish_reason:
                            return
                finally:
                    await source.aclose()
                raise _WorkerFailed(plan.decode, "Decode", grpc.StatusCode.UNAVAILABLE, "stream ended early")
            except (_WorkerFailed, SessionError) as err:
                attempt = await self._after_failure(err, plan, request_id, attempt, exclude, generated)
            finally:
                self._release(plan)

    async def collect(self, request_id: str, prompt: list[int], params: pb.SamplingParams,
                      sink: Callable[[pb.TokenChunk], bool], plan_out: list[Plan] | None = None,
                      min_chunk_tokens: int = 0, trace: Metadata = (), lora: str = "") -> None:
        """``run`` for a caller that answers only at the end: each chunk goes to ``sink`` as it arrives (from the
        session's reader, with no generator step per chunk and none per layer), which returns True once it needs
        no more (a stop string matched: the rest is aborted). Same retries, migration and cancellation as ``run``:
        ``sink`` sees every token once, in order, across attempts."""
        generated: list[int] = []
        exclude: set[str] = set()
        attempt = 0

        def take(chunk: pb.TokenChunk) -> bool:
            generated.extend(chunk.token_ids)
            return sink(chunk)

        while True:
            plan, rid, full, cont = self._next_attempt(request_id, attempt, prompt, params, generated, exclude,
                                                       plan_out, lora)
            try:
                if plan.mode == "colocated":
                    session = plan.decode.session
                    assert session is not None
                    await session.collect(pb.GenerateRequest(request_id=rid, prompt_token_ids=full, params=cont,
                                                             min_chunk_tokens=min_chunk_tokens, lora=lora),
                                          self.config.rpc_timeout_s, take)
                    return
                async with contextlib.aclosing(self._disaggregated_run(plan, rid, full, cont,
                                                                       min_chunk_tokens, trace)) as chunks:
                    async for chunk in chunks:
                        if take(chunk) or chunk.finish_reason:
                            return
                raise _WorkerFailed(plan.decode, "Decode", grpc.StatusCode.UNAVAILABLE, "stream ended early")
            except (_WorkerFailed, SessionError) as err:
                attempt = await self._after_failure(err, plan, request_id, attempt, exclude, generated)
            finally:
                self._release(plan)

    def _next_attempt(self, request_id: str, attempt: int, prompt: list[int], params: pb.SamplingParams,
                      generated: list[int], exclude: set[str],
                      plan_out: list[Plan] | None, lora: str = "") -> tuple[Plan, str, list[int], pb.SamplingParams]:
        """Plan attempt ``attempt`` (see ``_attempt_args``)."""
        rid, full, cont = self._attempt_args(request_id, attempt, prompt, params, generated)
        plan = self.plan(full, exclude, lora)
        if plan_out is not None:
            plan_out.append(plan)
        return plan, rid, full, cont

    @staticmethod
    def _attempt_args(request_id: str, attempt: int, prompt: list[int], params: pb.SamplingParams,
                      generated: list[int]) -> tuple[str, list[int], pb.SamplingParams]:
        """An attempt's request id, prompt and params: after a migration the prompt grows by what was generated
        and the budget shrinks by it."""
        if generated:
            cont = pb.SamplingParams()
            cont.CopyFrom(params)
            cont.max_tokens = params.max_tokens - len(generated)
            cont.min_tokens = max(0, params.min_tokens - len(generated))
            if cont.HasField("structured"):  # the new worker replays them into a fresh grammar matcher
                cont.structured.num_replay_tokens = len(generated)
            return f"{request_id}.{attempt}", prompt + generated, cont
        return f"{request_id}.{attempt}", prompt, params

    async def _after_failure(self, err: _WorkerFailed | SessionError, plan: Plan, request_id: str, attempt: int,
                             exclude: set[str], generated: list[int]) -> int:
        """A failed attempt: raise DispatchError if it cannot be retried or was the last; else exclude the worker,
        back off and return the next attempt's number."""
        e = err if isinstance(err, _WorkerFailed) else _WorkerFailed(plan.decode, "Generate", err.code, err.details)
        if e.code not in _RETRYABLE:
            raise DispatchError(400 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 500, e.details) from None
        attempt += 1
        exclude.add(e.worker.address)
        if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            # This request moves on (``exclude``); whether the others lose the worker is the probe's call (a
            # request's own failure, such as its KV transfer's, says nothing about the worker: router/pool.py).
            self.pool.suspect(e.worker)
        if attempt >= self.config.max_attempts:
            raise DispatchError(503, f"request failed after {attempt} attempts: {e}", retry_after=1.0) from None
        if generated:
            self.stats.migrations += 1
            log.warning("migrating %s after %d tokens: %s", request_id, len(generated), e)
        else:
            self.stats.retries += 1
            log.warning("retrying %s: %s", request_id, e)
        await asyncio.sleep(self.config.backoff_s * (2 ** (attempt - 1)))
        return attempt

    async def _disaggregated_run(self, plan: Plan, rid: str, prompt: list[int], params: pb.SamplingParams,
                                 min_chunk_tokens: int, trace: Metadata) -> AsyncGenerator[pb.TokenChunk, None]:
        """Reserve → Prefill → Decode; a request that does not finish is aborted on both workers."""
        touched: list[Worker] = [plan.decode] + ([plan.prefill] if plan.prefill else [])
        finished = False
        try:
            async with contextlib.aclosing(self._disaggregated(plan, rid, prompt, params,
                                                               min_chunk_tokens, trace)) as chunks:
                async for chunk in chunks:
                    finished = bool(chunk.finish_reason)
                    yield chunk
        finally:
            if not finished:
                for w in touched:
                    task = asyncio.ensure_future(_abort(w, rid))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)

    async def _disaggregated(self, plan: Plan, rid: str, prompt: list[int], params: pb.SamplingParams,
                             min_chunk_tokens: int, trace: Metadata) -> AsyncGenerator[pb.TokenChunk, None]:
        assert plan.prefill is not None and plan.decode.stub is not None and plan.prefill.stub is not None
        t = self.config.rpc_timeout_s
        meta = trace or None
        lease = self.config.lease_ms
        lora = pb.LoRARef(name=plan.lora, content_hash=plan.prefill.loras.get(plan.lora, "")) if plan.lora else None
        reserve = await _unary(plan.decode, "Reserve", plan.decode.stub.Reserve(
            pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt, params=params, lease_ms=lease, lora=lora),
            timeout=t, metadata=meta))
        if plan.lora and reserve.lora.name != plan.lora:  # a decode worker that does not apply adapters
            raise _WorkerFailed(plan.decode, "Reserve", grpc.StatusCode.FAILED_PRECONDITION,
                                f"the decode worker did not take LoRA adapter {plan.lora!r} for the hand-off")
        first = await _unary(plan.prefill, "Prefill", plan.prefill.stub.Prefill(
            pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                              destination=reserve.destination, lease_ms=lease,
                              lora=reserve.lora if plan.lora else None), timeout=t, metadata=meta))
        dreq = pb.DecodeRequest(request_id=rid, first_token_id=first.first_token_id,
                                min_chunk_tokens=min_chunk_tokens, first_token_sent=True)
        if first.HasField("first_logprob"):
            dreq.first_logprob.CopyFrom(first.first_logprob)
        yield first_chunk(first, len(prompt))  # at once: decode's stream starts only once the KV has landed
        session = plan.decode.session
        if session is not None and not trace:
            # Batched with every other request on the worker's session: one message per engine step, not one per
            # token per request. A trace context travels only as the Decode call's metadata: that path keeps it.
            source = _session_decode(session, plan.decode, dreq, t, self.config.max_buffered_tokens)
        else:
            call = plan.decode.stub.Decode(dreq, timeout=t, metadata=meta)
            source = _paced(call, plan.decode, rid, self.config.max_buffered_tokens)
        async with contextlib.aclosing(source) as chunks:
            async for chunk in chunks:
                if not chunk.num_cached_tokens:
                    chunk.num_cached_tokens = first.num_cached_tokens
                yield chunk


def _select(selector: Selector, prompt: list[int], workers: list[Worker], lora: str) -> Any:
    """``selector.select`` over ``workers``; for a LoRA adapter with its keys and its holders (router/cost.py)."""
    ids = [w.worker_id for w in workers]
    if not lora:
        return selector.select(prompt, ids)
    return selector.select(prompt, ids, lora=lora, holders=[w.worker_id for w in workers if lora in w.resident_loras])


def first_chunk(first: pb.PrefillResponse, num_prompt_tokens: int) -> pb.TokenChunk:
    """Prefill's first token as a request's first chunk (the decode stream then starts at the second)."""
    chunk = pb.TokenChunk(token_ids=[first.first_token_id], text=first.first_text,
                          num_cached_tokens=first.num_cached_tokens, num_prompt_tokens=num_prompt_tokens,
                          prompt_logprobs=first.prompt_logprobs)
    if first.HasField("first_logprob"):
        chunk.logprobs.append(first.first_logprob)
    return chunk


def _header(d: Any) -> str:
    chosen = next((b for b in getattr(d, "breakdowns", ()) if b.worker_id == d.worker_id), None)
    return chosen.as_header() if chosen is not None and hasattr(chosen, "as_header") else str(d.worker_id)


@contextlib.contextmanager
def _on(w: Worker, step: str, call: Any) -> Iterator[None]:
    """Around a gRPC ``call`` to ``w``: registered in ``w.calls`` while it runs (a cut-off cancels it), its RPC
    error raised as _WorkerFailed, and a cancellation that came from the cut-off (not from the request's own task
    being cancelled) raised as an UNAVAILABLE _WorkerFailed, so the request is retried or migrated."""
    w.calls.add(call)
    try:
        yield
    except grpc.aio.AioRpcError as e:
        raise _WorkerFailed(w, step, e.code(), e.details() or "") from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if w.cut_off and (task is None or not task.cancelling()):
            raise _WorkerFailed(w, step, grpc.StatusCode.UNAVAILABLE, f"worker {w.address} stopped answering") \
                from None
        raise
    finally:
        w.calls.discard(call)


async def _unary(w: Worker, step: str, call: Any) -> Any:
    with _on(w, step, call):
        return await call


async def _stream(call: Any, w: Worker, step: str) -> AsyncGenerator[pb.TokenChunk, None]:
    ended = False
    try:
        with _on(w, step, call):
            async for chunk in call:
                ended = bool(chunk.finish_reason)
                w.last_traffic = time.monotonic()  # liveness from traffic (router/pool.py)
                yield chunk
    finally:
        if not ended:
            call.cancel()
        elif not call.done():
            # The last chunk is in and the status is on its way: cancelling now would reset the stream on the
            # worker. Cancel only a call that is still open a while later (a no-op once it has completed).
            asyncio.get_running_loop().call_later(_LINGER_S, call.cancel)


async def _paced(call: Any, w: Worker, rid: str, limit: int) -> AsyncGenerator[pb.TokenChunk, None]:
    """``Decode``'s stream, read ahead of the consumer by a task into a buffer of at most ``limit`` tokens. Past
    that (the client reads slowly) the request is paused on the worker, over the router's session to it
    (worker/parking.py), and resumed once the consumer has taken the buffer down to half: HTTP/2 flow control
    alone would let the worker generate a whole window of small chunks (thousands of tokens) ahead of a client
    that reads nothing."""
    buf: deque[pb.TokenChunk] = deque()
    buffered = 0
    paused = False
    ended = False
    error: BaseException | None = None
    wake = asyncio.Event()
    session = w.session

    async def pump() -> None:
        nonlocal buffered, paused, ended, error
        try:
            async for chunk in _stream(call, w, "Decode"):
                buf.append(chunk)
                buffered += len(chunk.token_ids)
                if buffered > limit and not paused and not chunk.finish_reason and session is not None:
                    paused = True
                    session.pace(rid, True)
                wake.set()
        except Exception as e:  # handed to the consumer
            error = e
        finally:
            ended = True
            wake.set()

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            if buf:
                chunk = buf.popleft()
                buffered -= len(chunk.token_ids)
                if paused and buffered <= limit // 2 and session is not None:
                    paused = False
                    session.pace(rid, False)
                yield chunk
                continue
            if ended:
                if error is not None:
                    raise error
                return
            wake.clear()
            await wake.wait()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _session_decode(session: WorkerSession, w: Worker, request: pb.DecodeRequest, timeout_s: float,
                          limit: int) -> AsyncGenerator[pb.TokenChunk, None]:
    """``Decode`` over the worker's session (router/session.py): the same chunks, the same backpressure (the
    session pauses the request past ``limit`` buffered tokens), its failure raised as the call's would be."""
    chunks = session.decode(request, timeout_s, limit)
    try:
        async for chunk in chunks:
            yield chunk
    except SessionError as e:
        raise _WorkerFailed(w, "Decode", e.code, e.details) from None
    finally:
        await chunks.aclose()


async def _abort(w: Worker, rid: str) -> None:
    if w.stub is None:
        return
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await w.stub.Abort(pb.AbortRequest(request_id=rid), timeout=2.0)
