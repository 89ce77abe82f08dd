"""OpenAI-compatible HTTP gateway: ``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE), ``/v1/models``
and ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/version`` (router/openai_endpoints.py), ``/health`` and
``/metrics``. Response bodies and stream pieces are shaped in router/openai_responses.py.

Tokenization happens once, here; workers see token ids only. Text is produced here too, by one incremental
detokenizer per choice over the token ids the workers stream (stop strings included), so a stream migrated to
another worker pair mid-way continues byte for byte. A client that disconnects cancels its handler, which aborts
the request on every worker it reached. ``x-tandem-explain: 1`` on a request returns the routing decision and its
cost breakdown in the ``x-tandem-route`` response header.

Each request is its own ASGI call (router/asgi.py, served by granian: router/http_server.py): it is parsed and
validated, in a thread when its body is large (JSON, tokenisation and chat templating; ``tokenizers`` releases the
GIL), before it joins anything shared; then admitted (router/admission.py: a bounded number in flight per worker
tier, 429 with ``Retry-After`` beyond), then dispatched. A prompt longer than ``max_prompt_bytes`` is refused with
413 before it is tokenised. One request's bad input or failure answers that request only.

API keys (auth/api_keys.py): with keys configured, every endpoint but ``/health`` needs ``Authorization: Bearer
KEY`` (401 otherwise), and ``x-tandem-explain`` is honoured only for an admin key.

LoRA adapters: ``/v1/models`` lists every adapter a worker of the pool serves, with ``parent`` the served model (the
shape of vLLM's list), and a request whose ``model`` names one runs under it (router/dispatch.py); a ``model`` that
is neither gets a 404 naming it before any worker is reached. ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (router/lora_admin.py) take an admin key (403 for another key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import AsyncGenerator, Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from auth.api_keys import ApiKeys
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.admission import Admission, AdmissionConfig, retry_after_header
from router.api_error import APIError
from router.asgi import Request, Response, StreamResponse
from router.chat_output import REASONING_PARSERS
from router.dispatch import Dispatcher, DispatchError, Plan
from router.lora_admin import LoRAAdmin
from router.metrics import RouterMetrics
from router.openai_endpoints import UtilityEndpoints
from router.openai_protocol import GenerationRequest, parse_request, usage
from router.openai_responses import (
    Choice,
    chat_deltas,
    chat_logprobs,
    completion_piece,
    final_body,
    new_choice,
    take_prompt_logprobs,
)
from router.pool import WorkerPool
from router.tool_parsers import PARSERS

if TYPE_CHECKING:
    from router.tracing import RequestTracer

log = logging.getLogger(__name__)
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    vocab_size: int
    max_prompt_bytes: int = 2 << 20  # UTF-8 bytes of prompt text (or chat contents): 413 beyond, before tokenising
    inline_parse_bytes: int = 4096  # bodies up to this are parsed on the loop (tens of µs); larger ones in a thread
    parse_threads: int = 2
    metrics_on_main_port: bool = True  # False: /metrics is served on a port of its own (router/http_server.py)
    # A non-streaming request is answered once, at the end, so the workers may send its tokens in chunks of this
    # many (worker.proto's output pacing): one gRPC message for a short answer instead of one per token.
    collect_chunk_tokens: int = 32
    tool_call_parser: str = "hermes"  # how the model writes tool calls (router/tool_parsers.py)
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: <think>...</think> becomes reasoning_content

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.collect_chunk_tokens < 0:
            raise ValueError(f"collect_chunk_tokens must be >= 0, got {self.collect_chunk_tokens}")
        if self.max_prompt_bytes < 1 or self.inline_parse_bytes < 0 or self.parse_threads < 1:
            raise ValueError("max_prompt_bytes and parse_threads must be >= 1, inline_parse_bytes >= 0")
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")


_Item = tuple[Choice, str, list[pb.TokenLogprob]] | BaseException  # one streamed chunk of a choice, or its error


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, dispatcher: Dispatcher,
                 metrics: RouterMetrics, keys: ApiKeys | None = None,
                 admission: AdmissionConfig | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.tracer: RequestTracer | None = None  # set by build_router with --otlp-endpoint (router/tracing.py)
        self.keys = keys or ApiKeys()
        self.admission = Admission(admission or AdmissionConfig(), dispatcher.pool, metrics)
        self._parser = ThreadPoolExecutor(config.parse_threads, thread_name_prefix="tandem-parse")
        self.routes: dict[tuple[str, str], Any] = {
            ("POST", "/v1/completions"): self.completions, ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models, ("GET", "/health"): self.health,
            ("POST", "/tokenize"): self.tokenize, ("POST", "/detokenize"): self.detokenize,
            ("GET", "/version"): self.version, ("POST", "/v1/load_lora_adapter"): self.load_lora_adapter,
            ("POST", "/v1/unload_lora_adapter"): self.unload_lora_adapter}
        self.lora_admin = LoRAAdmin(dispatcher.pool, config.model_name)
        self.extras = UtilityEndpoints(tokenizer, config.model_name, config.max_model_len, config.vocab_size,
                                       config.max_prompt_bytes, lambda: _PoolAdapters(dispatcher.pool))
        if config.metrics_on_main_port:
            self.routes[("GET", "/metrics")] = self.render_metrics
        self.paths = frozenset(path for _, path in self.routes) | {"/metrics"}
        dispatcher.on_decision = self._count_decision

    def count(self, path: str, status: int) -> None:
        """Count one response (every status, refusals by the HTTP layer included) by endpoint and status."""
        self.metrics.requests.labels(path if path in self.paths else "other", str(status)).inc()

    def close(self) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)

    def _count_decision(self, plan: Plan) -> None:
        self.metrics.decisions.labels(plan.mode, plan.reason).inc()

    async def handle(self, request: Request) -> Response | StreamResponse:
        """The ASGI app's handler (router/asgi.py): authenticate, route, run, and answer errors OpenAI's way."""
        routes = self.routes
        method = "GET" if request.method == "HEAD" else request.method
        route = routes.get((method, request.path))
        if route is None and method == "GET" and request.path.startswith("/v1/models/"):
            route = self.model_by_id
        try:
            if request.path != "/health":
                self.authenticate(request)
            if route is None:
                if any(path == request.path for _, path in routes):
                    raise APIError(405, f"method {request.method} is not allowed on {request.path}")
                raise APIError(404, f"no such endpoint: {request.path}")
            resp: Response | StreamResponse = await route(request)
            return resp
        except APIError as e:
            return self._error(e)

    def authenticate(self, request: Request) -> None:
        """401 without a valid key (when keys are configured); ``request.explain`` for an admin key only."""
        caller = self.keys.check(request.headers.get("authorization"))
        if caller is None:
            given = "authorization" in request.headers
            raise APIError(401, "Incorrect API key provided." if given else
                           "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
        request.explain = caller.admin and request.headers.get("x-tandem-explain") == "1"

    def _error(self, e: APIError) -> Response:
        headers = {"Retry-After": retry_after_header(e.retry_after)} if e.retry_after else None
        if e.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return _json(e.body(), status=e.status, headers=headers)

    # ---- endpoints -----------------------------------------------------------------------------------------

    def adapters(self) -> frozenset[str]:
        """The LoRA adapters some worker serves now (a request's ``model`` may name one)."""
        return frozenset(self.dispatcher.pool.adapters())

    def adapter_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "tandem", "root": name,
                "parent": self.config.model_name, "max_model_len": self.config.max_model_len}

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "tandem",
             "max_model_len": self.config.max_model_len},
            *(self.adapter_card(name) for name in sorted(self.adapters()))]})

    async def model_by_id(self, request: Request) -> Response:
        model_id = urllib.parse.unquote(request.path[len("/v1/models/"):])
        if model_id != self.config.model_name and model_id in self.adapters():
            return _json(self.adapter_card(model_id))
        return _json(self.extras.model(model_id))

    def _admin_only(self, request: Request) -> None:
        """403 unless the caller's key is an admin key (the gateway's ``authenticate`` already let it in)."""
        caller = self.keys.check(request.headers.get("authorization"))
        if caller is None or not caller.admin:
            raise APIError(403, f"{request.path} needs an admin API key", code="insufficient_permissions")

    async def load_lora_adapter(self, request: Request) -> Response:
        self._admin_only(request)
        return _json(await self.lora_admin.load(_json_body(request.body)))

    async def unload_lora_adapter(self, request: Request) -> Response:
        self._admin_only(request)
        return _json(await self.lora_admin.unload(_json_body(request.body)))

    async def tokenize(self, request: Request) -> Response:
        return _json(await self.extras.tokenize(request.body))

    async def detokenize(self, request: Request) -> Response:
        return _json(await self.extras.detokenize(request.body))

    async def version(self, request: Request) -> Response:
        return _json(self.extras.version())

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
        t0 = time.perf_counter()
        req = await self._parse(request, chat)
        with self.admitted():
            self.metrics.prompt_tokens.inc(req.num_prompt_tokens * req.best_of)
            choices = [self._choice(req, i) for i in range(len(req.prompts) * req.best_of)]
            self.begin_trace(choices, t0)
            plans: list[Plan] = []
            if req.stream:
                return await self._stream(request, req, choices, plans, request.explain, t0)
            if len(choices) == 1:
                await self._collect(req, choices[0], plans)  # no task to fan out to
            else:
                await asyncio.gather(*(self._collect(req, c, plans) for c in choices))
            return self._answer(request, req, choices, plans, t0)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Hold an admission slot for the block's duration (429 or 503 raised when none is free)."""
        self.admission.enter()
        try:
            yield
        finally:
            self.admission.leave()

    async def _parse(self, request: Request, chat: bool) -> GenerationRequest:
        return await self.parse(request.body, chat, len(request.body))

    async def parse(self, raw: bytes | dict[str, Any], chat: bool, size: int) -> GenerationRequest:
        """Parse and validate a body of about ``size`` bytes: on the loop when it is small, in the parser threads
        when it is not."""
        if size <= self.config.inline_parse_bytes:  # on the loop: the pool is read only if model is not the base's
            return self.parse_body(raw, chat, _PoolAdapters(self.dispatcher.pool))
        loop = asyncio.get_running_loop()
        adapters = self.adapters()  # read here, on the loop, where the pool changes
        return await loop.run_in_executor(self._parser, self.parse_body, raw, chat, adapters)

    def parse_body(self, raw: bytes | dict[str, Any], chat: bool,
                   adapters: Collection[str] = frozenset()) -> GenerationRequest:
        """JSON → a validated, tokenised request (any thread). The prompt's bytes are capped before tokenising."""
        cfg = self.config
        if isinstance(raw, bytes | bytearray):
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise APIError(400, "request body is not valid JSON") from None
            # A JSON string is at least as long as its UTF-8 text, so a small body needs no walk.
            if len(raw) > cfg.max_prompt_bytes and _prompt_bytes(body, chat) > cfg.max_prompt_bytes:
                raise APIError(413, f"the prompt is longer than {cfg.max_prompt_bytes} bytes",
                               "messages" if chat else "prompt")
        else:
            body = raw
            if _prompt_bytes(body, chat) > cfg.max_prompt_bytes:
                raise APIError(413, f"the prompt is longer than {cfg.max_prompt_bytes} bytes",
                               "messages" if chat else "prompt")
        return parse_request(body, chat, self.tokenizer, cfg.model_name, cfg.max_model_len, cfg.vocab_size,
                             cfg.tool_call_parser, cfg.reasoning_parser, adapters)

    def _choice(self, req: GenerationRequest, index: int) -> Choice:
        return new_choice(req, index, self.tokenizer)

    def _answer(self, request: Request, req: GenerationRequest, choices: list[Choice], plans: list[Plan],
                t0: float) -> Response:
        """The whole answer of a request whose choices are all done."""
        self.metrics.e2e.observe(time.perf_counter() - t0)
        self.request_done(req.num_prompt_tokens, choices, t0, plans, request.path)
        headers = {"x-tandem-route": _route_header(plans)} if request.explain else None
        return _json(self._final_body(req, choices), headers=headers)

    def request_done(self, prompt_tokens: int, choices: list[Choice], t0: float, plans: list[Plan],
                     endpoint: str) -> None:
        """Observe a finished request's phases, token counts and finish reasons (router/metric_catalogue.py), and
        trace it when tracing is on (router/tracing.py)."""
        firsts = [c.first_at for c in choices if c.first_at]
        end = time.perf_counter()
        dispatched = min(c.created_at for c in choices)
        self.metrics.request_done(prompt_tokens, [len(c.token_ids) for c in choices],
                                  (c.finish_reason for c in choices), t0, dispatched, min(firsts, default=0.0), end)
        if self.tracer is not None:
            from router.tracing import Phases

            c = choices[0]
            self.tracer.record(endpoint, plans[0].mode if plans else "unknown",
                               Phases(t0, dispatched, c.first_at, c.second_at, end),
                               {"tandem.prompt_tokens": prompt_tokens, "tandem.sequences": len(choices),
                                "tandem.generated_tokens": sum(len(ch.token_ids) for ch in choices),
                                "tandem.attempts": len(plans)}, c.trace_root)

    def begin_trace(self, choices: list[Choice], t0: float) -> None:
        """Open the request's root span when tracing is on: its choices carry it and its trace context, which the
        dispatcher sends to the workers (router/tracing.py)."""
        if self.tracer is not None:
            root = self.tracer.begin(t0)
            meta = self.tracer.metadata(root)
            for c in choices:
                c.trace_root, c.trace_metadata = root, meta

    def admit(self) -> None:
        """Check that a request would be admitted now (no slot is taken: see ``admitted``)."""
        self.admission.enter()
        self.admission.leave()

    def _params_for(self, req: GenerationRequest, index: int) -> pb.SamplingParams:
        if not index or not req.params.HasField("seed"):
            return req.params  # the dispatcher copies before it changes anything
        params = pb.SamplingParams()
        params.CopyFrom(req.params)
        params.seed = params.seed + index
        return params

    def _run(self, req: GenerationRequest, c: Choice, plans: list[Plan]) -> AsyncGenerator[pb.TokenChunk, None]:
        return self.dispatcher.run(f"{req.request_id}-{c.index}", c.prompt or req.prompt_token_ids,
                                   self._params_for(req, c.index), plans,
                                   0 if req.stream else self.config.collect_chunk_tokens, c.trace_metadata,
                                   req.lora)

    def _absorb(self, req: GenerationRequest, c: Choice, chunk: pb.TokenChunk) -> str:
        """Take one chunk into ``c`` (tokens, text, logprobs, finish reason); return its new text."""
        c.cached = max(c.cached, chunk.num_cached_tokens)
        if chunk.token_ids:  # phase timestamps (metrics and traces): first token, then decode's first chunk
            if not c.first_at:
                c.first_at = time.perf_counter()
            elif not c.second_at:
                c.second_at = time.perf_counter()
        take_prompt_logprobs(c, chunk)
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
            await self.dispatcher.collect(f"{req.request_id}-{c.index}", c.prompt or req.prompt_token_ids,
                                          self._params_for(req, c.index), self._sink(req, c), plans,
                                          self.config.collect_chunk_tokens, c.trace_metadata, req.lora)
        except DispatchError as e:
            raise APIError(e.status, e.message, retry_after=e.retry_after) from None
        finally:
            self.metrics.cached_tokens.inc(c.cached)

    def _final_body(self, req: GenerationRequest, choices: list[Choice]) -> dict[str, Any]:
        return final_body(req, choices, self._tok, self.tokenizer.decode)

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
                        lp = chat_logprobs(self._tok, lps) if req.want_logprobs else None
                        deltas, finish = chat_deltas(c, text, bool(lps))  # content, reasoning, tool calls
                        for j, delta in enumerate(deltas):
                            await _sse(resp, self._chunk(req, obj, c.index, delta, None, None if j else lp))
                        if finish:
                            await _sse(resp, self._chunk(req, obj, c.index, {}, finish, None))
                    else:
                        await _sse(resp, {"id": req.request_id, "object": obj, "created": req.created,
                                          "model": req.model, "choices": [completion_piece(
                                              req, c, text, lps, self._tok, self.tokenizer.decode)]})
            if not started:
                await resp.prepare(request)
            if req.include_usage:
                await _sse(resp, {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
                                  "choices": [], "usage": usage(req.num_prompt_tokens,
                                                                sum(len(c.token_ids) for c in choices),
                                                                max(c.cached for c in choices))})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.metrics.e2e.observe(time.perf_counter() - t0)
            self.request_done(req.num_prompt_tokens, choices, t0, plans, request.path)
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
        # Bounded: a client that reads slowly holds the pumps back, and through them the workers (backpressure,
        # router/session.py); an unbounded queue would take every token as fast as the workers make it.
        queue: asyncio.Queue[_Item | None] = asyncio.Queue(maxsize=4 * len(choices))

        async def pump(c: Choice) -> None:
            try:
                sent = 0
                async for text in self.choice_texts(req, c, plans):
                    await queue.put((c, text, c.logprobs[sent:]))
                    sent = len(c.logprobs)
                await queue.put(None)
            except asyncio.CancelledError:  # the stream ended: nobody reads the queue any more
                raise
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



async def _sse(resp: StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response serialised by orjson (several times faster than json.dumps on these bodies)."""
    return Response(orjson.dumps(obj), status=status, headers=headers)


def _route_header(plans: list[Plan]) -> str:
    return " | ".join(f"{p.mode}:{p.reason}:{p.breakdown}" for p in plans)[:4000]


class _PoolAdapters(Collection[str]):
    """The pool's LoRA adapter names, read when asked (a request of the base model never asks); on the loop only."""

    __slots__ = ("pool",)

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def __contains__(self, name: object) -> bool:
        return any(name in w.loras for w in self.pool.workers.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self.pool.adapters())

    def __len__(self) -> int:
        return len(self.pool.adapters())


def _json_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise APIError(400, "request body is not valid JSON") from None


def _prompt_bytes(body: Any, chat: bool) -> int:
    """UTF-8 bytes of a body's prompt text (completions: ``prompt``, a string or a list of them; chat: every
    message's string content and text parts). Anything of another shape counts 0: ``parse_request`` refuses it."""
    if not isinstance(body, dict):
        return 0
    texts: list[Any] = []
    if chat:
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                texts.extend(p.get("text") for p in content if isinstance(p, dict))
            else:
                texts.append(content)
    else:
        prompt = body.get("prompt")
        texts.extend(prompt if isinstance(prompt, list) else [prompt])
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
