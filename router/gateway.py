"""OpenAI-compatible HTTP gateway: ``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE), ``/v1/models``,
``/health`` and ``/metrics``.

Tokenization happens once, here; workers see token ids only. Text is produced here too, by one incremental
detokenizer per choice over the token ids the workers stream (stop strings included), so a stream migrated to
another worker pair mid-way continues byte for byte. A client that disconnects cancels its handler, which aborts
the request on every worker it reached. ``x-tandem-explain: 1`` on a request returns the routing decision and its
cost breakdown in the ``x-tandem-route`` response header.

Two paths serve a request. The coroutine path (``handle``) runs a handler task per request and serves everything.
The express lane (``express``, called by the HTTP server with a loop iteration's new requests) starts a non-streamed
single choice with no task, future or generator at all: parsed, planned and written to its worker's session from
the server's callback, absorbed chunk by chunk from the session's reader, answered from the session's completion
callback. Anything it does not finish that way (a failed attempt, a disaggregated plan) continues in a task on the
same dispatcher code, and anything else (streams, ``n`` > 1, other endpoints) goes to ``handle`` already parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.dispatch import Attempts, Dispatcher, DispatchError, Plan
from router.http import Request, Response, StreamResponse
from router.metrics import RouterMetrics
from router.openai_protocol import APIError, GenerationRequest, parse_request, usage
from router.session import SessionError

log = logging.getLogger(__name__)
MAX_BODY = 8 << 20


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    max_waiting_per_worker: int = 256
    # A non-streaming request is answered once, at the end, so the workers may send its tokens in chunks of this
    # many (worker.proto's output pacing): one gRPC message for a short answer instead of one per token.
    collect_chunk_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.collect_chunk_tokens < 0:
            raise ValueError(f"collect_chunk_tokens must be >= 0, got {self.collect_chunk_tokens}")


@dataclass(slots=True)
class Choice:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    cached: int = 0


_Item = tuple[Choice, str, list[pb.TokenLogprob]] | BaseException  # one streamed chunk of a choice, or its error


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, dispatcher: Dispatcher,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.routes: dict[tuple[str, str], Any] = {
            ("POST", "/v1/completions"): self.completions, ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models, ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.render_metrics}
        dispatcher.on_decision = self._count_decision

    def _count_decision(self, plan: Plan) -> None:
        self.metrics.decisions.labels(plan.mode, plan.reason).inc()

    async def handle(self, request: Request) -> Response | StreamResponse:
        """The HTTP server's handler (router/http.py): route, run, and answer errors OpenAI's way."""
        routes = self.routes
        method = "GET" if request.method == "HEAD" else request.method
        route = routes.get((method, request.path))
        try:
            if route is None:
                if any(path == request.path for _, path in routes):
                    raise APIError(405, f"method {request.method} is not allowed on {request.path}")
                raise APIError(404, f"no such endpoint: {request.path}")
            resp: Response | StreamResponse = await route(request)
            return resp
        except APIError as e:
            return self._error(request, e, known=route is not None)

    def _error(self, request: Request, e: APIError, known: bool = True) -> Response:
        self.metrics.requests.labels(request.path if known else "other", str(e.status)).inc()
        headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after else None
        return _json(e.body(), status=e.status, headers=headers)

    # ---- endpoints -----------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "tandem",
             "max_model_len": self.config.max_model_len}]})

    async def health(self, request: Request) -> Response:
        pool = self.dispatcher.pool
        decode = pool.available("decode")
        body = {"status": "ok" if decode else "unavailable", "decode_workers": len(decode),
                "prefill_workers": len(pool.available("prefill"))}
        return _json(body, status=200 if decode else 503)

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response | StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | StreamResponse:
        return await self._serve(request, chat=True)

    # ---- the work ------------------------------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool) -> Response | StreamResponse:
        if request.state is not None:  # parsed and admitted by the express lane, which handed it over
            req, t0 = request.state
        else:
            t0 = time.perf_counter()
            req = self._parse(request, chat)
            self.admit()
            self.metrics.prompt_tokens.inc(len(req.prompt_token_ids) * req.n)
        choices = [self._choice(req, i) for i in range(req.n)]
        plans: list[Plan] = []
        if req.stream:
            return await self._stream(request, req, choices, plans,
                                      request.headers.get("x-tandem-explain") == "1", t0)
        if len(choices) == 1:
            await self._collect(req, choices[0], plans)  # no task to fan out to
        else:
            await asyncio.gather(*(self._collect(req, c, plans) for c in choices))
        return self._answer(request, req, choices, plans, t0)

    def _parse(self, request: Request, chat: bool) -> GenerationRequest:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            raise APIError(400, "request body is not valid JSON") from None
        cfg = self.config
        return parse_request(body, chat, self.tokenizer, cfg.model_name, cfg.max_model_len, cfg.vocab_size)

    def _choice(self, req: GenerationRequest, index: int) -> Choice:
        return Choice(index, IncrementalDetokenizer(self.tokenizer, tuple(req.params.stop),
                                                    req.params.include_stop_str_in_output))

    def _answer(self, request: Request, req: GenerationRequest, choices: list[Choice], plans: list[Plan],
                t0: float) -> Response:
        """The whole answer of a request whose choices are all done."""
        self.metrics.e2e.observe(time.perf_counter() - t0)
        self.metrics.requests.labels(request.path, "200").inc()
        headers = ({"x-tandem-route": _route_header(plans)} if request.headers.get("x-tandem-explain") == "1"
                   else None)
        return _json(self._final_body(req, choices), headers=headers)

    # ---- the express lane (router/http.py) -----------------------------------------------------------------

    def express(self, batch: list[Request]) -> None:
        """Start a loop iteration's new requests with no task each: a non-streamed single choice that plans
        colocated is sent on its worker's session from here and answered from the session's completion
        callback; a failed attempt continues in a task with the same retries and migration as the coroutine
        path (``Dispatcher.recover``, then ``collect``); a disaggregated plan runs in a task from the start;
        streams, ``n`` > 1 and every other endpoint go to ``handle``, already parsed where they were."""
        for request in batch:
            try:
                self._express_one(request)
            except APIError as e:
                request.answer(self._error(request, e))
            except DispatchError as e:
                request.answer(self._error(request, APIError(e.status, e.message, retry_after=e.retry_after)))

    def _express_one(self, request: Request) -> None:
        path = request.path
        if request.method != "POST" or (path != "/v1/completions" and path != "/v1/chat/completions"):
            request.fallback()
            return
        t0 = time.perf_counter()
        req = self._parse(request, path == "/v1/chat/completions")
        self.admit()
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids) * req.n)
        if req.stream or req.n != 1:
            request.state = (req, t0)
            request.fallback()
            return
        c = self._choice(req, 0)
        plans: list[Plan] = []
        d = self.dispatcher
        plan = d.first_plan(req.prompt_token_ids, plans)
        base = f"{req.request_id}-0"
        if plan.mode != "colocated" or plan.decode.session is None:
            request.continue_in(self._express_rest(request, req, c, plans, t0, Attempts(plan=plan)))
            return
        generated: list[int] = []
        absorb = self._sink(req, c)

        def sink(chunk: pb.TokenChunk) -> bool:
            generated.extend(chunk.token_ids)
            return absorb(chunk)

        def done(err: BaseException | None) -> None:
            request.on_cancel = None
            if err is None:
                d.release(plan)
                self.metrics.cached_tokens.inc(c.cached)
                request.answer(self._answer(request, req, [c], plans, t0))
            else:
                request.continue_in(self._express_rest(request, req, c, plans, t0, Attempts(generated), (plan, err)))

        try:
            cancel = plan.decode.session.submit(
                pb.GenerateRequest(request_id=f"{base}.0", prompt_token_ids=req.prompt_token_ids, params=req.params,
                                   min_chunk_tokens=self.config.collect_chunk_tokens),
                d.config.rpc_timeout_s, sink, done)
        except SessionError as e:
            done(e)
            return

        def on_cancel() -> None:  # the client went away
            cancel()
            d.release(plan)
            self.metrics.cached_tokens.inc(c.cached)

        request.on_cancel = on_cancel

    async def _express_rest(self, request: Request, req: GenerationRequest, c: Choice, plans: list[Plan],
                            t0: float, state: Attempts,
                            failed: tuple[Plan, BaseException] | None = None) -> Response:
        """The rest of an express request, in a task: recover from its failed first attempt (if it failed), then
        continue it as ``_collect`` would."""
        base = f"{req.request_id}-0"
        d = self.dispatcher
        try:
            if failed is not None:
                await d.recover(failed[1], failed[0], base, state)
            await d.collect(base, req.prompt_token_ids, req.params, self._sink(req, c), plans,
                            self.config.collect_chunk_tokens, attempts=state)
        except DispatchError as e:
            return self._error(request, APIError(e.status, e.message, retry_after=e.retry_after))
        finally:
            self.metrics.cached_tokens.inc(c.cached)
        return self._answer(request, req, [c], plans, t0)

    def admit(self) -> None:
        pool = self.dispatcher.pool
        decode = pool.available("decode")
        if not decode:
            raise APIError(503, "no decode worker is available", retry_after=1.0)
        waiting = sum(w.last_load.waiting for w in decode if w.last_load is not None)
        if waiting > self.config.max_waiting_per_worker * len(decode):
            raise APIError(429, f"server overloaded: {waiting} requests queued", err_type="rate_limit_error",
                           retry_after=1.0)

    def _params_for(self, req: GenerationRequest, index: int) -> pb.SamplingParams:
        if not index or not req.params.HasField("seed"):
            return req.params  # the dispatcher copies before it changes anything
        params = pb.SamplingParams()
        params.CopyFrom(req.params)
        params.seed = params.seed + index
        return params

    def _run(self, req: GenerationRequest, c: Choice, plans: list[Plan]) -> AsyncGenerator[pb.TokenChunk, None]:
        return self.dispatcher.run(f"{req.request_id}-{c.index}", req.prompt_token_ids, self._params_for(req, c.index),
                                   plans, 0 if req.stream else self.config.collect_chunk_tokens)

    def _absorb(self, req: GenerationRequest, c: Choice, chunk: pb.TokenChunk) -> str:
        """Take one chunk into ``c`` (tokens, text, logprobs, finish reason); return its new text."""
        c.cached = max(c.cached, chunk.num_cached_tokens)
        if c.detok.stop:  # token by token: the token that completes a stop string ends the choice
            new = ""
            for tok in chunk.token_ids:
                c.token_ids.append(tok)
                new += c.detok.add(tok, match_stops=len(c.token_ids) >= req.params.min_tokens)
                if c.detok.stopped_on is not None:
                    break
        else:
            c.token_ids.extend(chunk.token_ids)
            new = c.detok.add_many(list(chunk.token_ids))
        c.logprobs.extend(chunk.logprobs)
        if c.detok.stopped_on is not None:
            c.finish_reason = "stop"
        elif chunk.finish_reason:
            c.finish_reason = chunk.finish_reason
            new += c.detok.flush()
        c.text += new
        self.metrics.generation_tokens.inc(len(chunk.token_ids))
        return new

    async def choice_texts(self, req: GenerationRequest, c: Choice, plans: list[Plan]) -> AsyncGenerator[str, None]:
        """Run one choice; yield its new text per chunk (also recorded on ``c``)."""
        # Closed here in ``finally``: the dispatcher's generators end at once, not later from the loop's async-gen
        # finalizer (which would cost a task and a self-pipe wake-up per generator per request).
        run = self._run(req, c, plans)
        try:
            async for chunk in run:
                yield self._absorb(req, c, chunk)
                if c.finish_reason:
                    return
        except DispatchError as e:
            raise APIError(e.status, e.message, retry_after=e.retry_after) from None
        finally:
            await run.aclose()
            self.metrics.cached_tokens.inc(c.cached)

    def _sink(self, req: GenerationRequest, c: Choice) -> Callable[[pb.TokenChunk], bool]:
        """A collect sink for choice ``c``: absorb each chunk; True once the choice is done."""
        def sink(chunk: pb.TokenChunk) -> bool:
            self._absorb(req, c, chunk)
            return bool(c.finish_reason)

        return sink

    async def _collect(self, req: GenerationRequest, c: Choice, plans: list[Plan]) -> None:
        """Run one choice to its end for an answer sent whole: each chunk is absorbed as the session reads it."""
        try:
            await self.dispatcher.collect(f"{req.request_id}-{c.index}", req.prompt_token_ids,
                                          self._params_for(req, c.index), self._sink(req, c), plans,
                                          self.config.collect_chunk_tokens)
        except DispatchError as e:
            raise APIError(e.status, e.message, retry_after=e.retry_after) from None
        finally:
            self.metrics.cached_tokens.inc(c.cached)

    def _final_body(self, req: GenerationRequest, choices: list[Choice]) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in choices)
        out: dict[str, Any] = {"id": req.request_id, "created": req.created, "model": req.model,
                               "usage": usage(len(req.prompt_token_ids), completion,
                                              max((c.cached for c in choices), default=0))}
        if req.chat:
            out["object"] = "chat.completion"
            out["choices"] = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                               "logprobs": self._chat_logprobs(c.logprobs) if req.want_logprobs else None,
                               "finish_reason": c.finish_reason} for c in choices]
        else:
            prompt_text = self.tokenizer.decode(req.prompt_token_ids) if req.echo else ""
            out["object"] = "text_completion"
            out["choices"] = [{"index": c.index, "text": prompt_text + c.text,
                               "logprobs": self._completion_logprobs(c.logprobs) if req.want_logprobs else None,
                               "finish_reason": c.finish_reason} for c in choices]
        return out

    async def _stream(self, request: Request, req: GenerationRequest, choices: list[Choice],
                      plans: list[Plan], explain: bool, t0: float) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        tasks: list[asyncio.Task[None]] = []
        items = (self._one_choice(req, choices[0], plans) if len(choices) == 1
                 else self._fan_in(req, choices, plans, tasks))
        started = False
        last = None
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        try:
            async with contextlib.aclosing(items):
                async for item in items:
                    if isinstance(item, BaseException):
                        if not started:
                            raise item
                        await _sse(resp, {"error": APIError(500, str(item)).body()["error"]})
                        continue
                    c, text, lps = item
                    if not started:
                        if explain:
                            resp.headers["x-tandem-route"] = _route_header(plans)
                        await resp.prepare(request)
                        started = True
                        self.metrics.ttft.labels(plans[0].mode if plans else "unknown").observe(
                            time.perf_counter() - t0)
                        if req.chat:
                            for ch in choices:
                                await _sse(resp, self._chunk(req, obj, ch.index, {"role": "assistant",
                                                                                  "content": ""}, None, None))
                    now = time.perf_counter()
                    if last is not None:
                        self.metrics.itl.observe(now - last)
                    last = now
                    if req.chat:
                        lp = self._chat_logprobs(lps) if req.want_logprobs else None
                        if text or lps:
                            await _sse(resp, self._chunk(req, obj, c.index, {"content": text}, None, lp))
                        if c.finish_reason:
                            await _sse(resp, self._chunk(req, obj, c.index, {}, c.finish_reason, None))
                    else:
                        lp = self._completion_logprobs(lps) if req.want_logprobs else None
                        await _sse(resp, self._chunk(req, obj, c.index, text, c.finish_reason, lp))
            if not started:
                await resp.prepare(request)
            if req.include_usage:
                await _sse(resp, {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
                                  "choices": [], "usage": usage(len(req.prompt_token_ids),
                                                                sum(len(c.token_ids) for c in choices),
                                                                max(c.cached for c in choices))})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.metrics.e2e.observe(time.perf_counter() - t0)
            self.metrics.requests.labels(request.path, "200").inc()
            return resp
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one_choice(self, req: GenerationRequest, c: Choice, plans: list[Plan]) -> AsyncGenerator[_Item, None]:
        """One choice's stream items, read in the handler's own task (no pump task, no queue hop per chunk).

        Yields what a pump would queue for the same choice: ``(choice, text, new logprobs)`` per chunk, then the
        exception that ended it, if any. The handler's own cancellation (the client went away) is not an item.
        """
        sent = 0
        try:
            async with contextlib.aclosing(self.choice_texts(req, c, plans)) as texts:
                async for text in texts:
                    yield c, text, c.logprobs[sent:]
                    sent = len(c.logprobs)
        except BaseException as e:  # surfaced to the client as an SSE error event
            task = asyncio.current_task()
            if isinstance(e, GeneratorExit) or (isinstance(e, asyncio.CancelledError) and task is not None
                                                and task.cancelling()):
                raise
            yield e

    async def _fan_in(self, req: GenerationRequest, choices: list[Choice], plans: list[Plan],
                      tasks: list[asyncio.Task[None]]) -> AsyncGenerator[_Item, None]:
        """Every choice's stream items as they come: one pump task per choice (added to ``tasks``), one queue."""
        queue: asyncio.Queue[_Item | None] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                sent = 0
                async for text in self.choice_texts(req, c, plans):
                    await queue.put((c, text, c.logprobs[sent:]))
                    sent = len(c.logprobs)
                await queue.put(None)
            except BaseException as e:  # surfaced to the client as an SSE error event
                await queue.put(e)

        tasks.extend(asyncio.create_task(pump(c)) for c in choices)
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if item is None or isinstance(item, BaseException):
                remaining -= 1
            if item is not None:
                yield item

    def _chunk(self, req: GenerationRequest, obj: str, index: int, payload: Any, finish: str | None,
               logprobs: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        choice["delta" if req.chat else "text"] = payload
        return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
                "choices": [choice]}

    def _tok(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, lps: list[pb.TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = self._tok(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in lps]}

    def _completion_logprobs(self, lps: list[pb.TokenLogprob]) -> dict[str, Any]:
        tokens = [self._tok(lp.token_id) for lp in lps]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._tok(t.token_id): t.logprob for t in lp.top} for lp in lps],
                "text_offset": offsets}


async def _sse(resp: StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response serialised by orjson (several times faster than json.dumps on these bodies)."""
    return Response(orjson.dumps(obj), status=status, headers=headers)


def _route_header(plans: list[Plan]) -> str:
    return " | ".join(f"{p.mode}:{p.reason}:{p.breakdown}" for p in plans)[:4000]
