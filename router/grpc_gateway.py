"""The router's client-facing gRPC API (``proto/tandem/v1/gateway.proto``), beside the OpenAI HTTP gateway.

One ``Complete`` (or ``Chat``) call::

    CompleteRequest ──as an OpenAI completions body──► parse_request (the HTTP gateway's validation, tokenizer)
    ChatRequest ──as an OpenAI chat body (messages, tools, tool_choice)──┘
        ──Gateway.admit──► Gateway.choice_texts (dispatcher: routing, retries, migration, detokenizer, stops)
        ──► CompleteChunk per worker chunk (new text, new token ids, new logprobs) ... last: finish_reason + usage
        ──► ChatChunk per worker chunk (new content, reasoning_content, tool_calls deltas: router/chat_output.py)

Everything after the request is parsed is the HTTP path's own code, so both APIs give the same tokens, text and
errors for the same request: a ``model`` naming a LoRA adapter runs under it, and ``Models`` lists the adapters with
their ``parent``. The structured output constraint (``structured``) becomes the HTTP body's
``response_format`` (JSON object, JSON schema) or ``structured_outputs`` (regex, choice, grammar), tools become
``tools`` and ``tool_choice``: the same validation, the same grammar and so, for the same seed, the same output.
An error names the field of *this* API it is about (``structured.json_schema: ...``), in the status details and in
the ``tandem-error-field`` trailing metadata. A cancelled call (client gone, deadline) cancels the handler, which
aborts the request on every worker it reached, as a dropped HTTP connection does.

With API keys configured (auth/api_keys.py), every call carries ``authorization: Bearer KEY`` metadata; a missing
or bad key gets ``UNAUTHENTICATED``. A call holds an admission slot (router/admission.py) from its first chunk to
its last; beyond the bound it gets ``RESOURCE_EXHAUSTED``, as HTTP gets 429.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from engine.detokenizer import IncrementalDetokenizer
from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from router.api_error import APIError
from router.dispatch import Plan
from router.gateway import Choice, Gateway
from router.openai_protocol import GenerationRequest
from router.openai_responses import chat_deltas, new_choice

log = logging.getLogger(__name__)

_PATH = "grpc:/tandem.v1.Gateway/Complete"
_CHAT_PATH = "grpc:/tandem.v1.Gateway/Chat"
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "min_tokens")
_OPTIONAL = (*_SAMPLING, "logprobs")
# The HTTP body's fields whose name differs in this API ("structured" is completed by its kind).
_FIELDS = {"response_format": "structured", "structured_outputs": "structured", "logprobs": "top_logprobs"}


def status_for(http_status: int) -> grpc.StatusCode:
    """The gRPC status of an HTTP gateway error."""
    if http_status == 401:
        return grpc.StatusCode.UNAUTHENTICATED
    if http_status == 413:
        return grpc.StatusCode.INVALID_ARGUMENT
    if http_status == 404:
        return grpc.StatusCode.NOT_FOUND
    if http_status == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if http_status == 503:
        return grpc.StatusCode.UNAVAILABLE
    if 400 <= http_status < 500:
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def field_name(param: str | None, request: gpb.CompleteRequest | gpb.ChatRequest) -> str | None:
    """The field of this API an HTTP gateway error's ``param`` is about."""
    if param is None:
        return None
    name = _FIELDS.get(param, param)
    if name == "structured":
        kind = request.structured.WhichOneof("kind")
        return f"structured.{kind}" if kind else name
    return name


def _common(body: dict[str, Any], request: gpb.CompleteRequest | gpb.ChatRequest,
            optional: tuple[str, ...]) -> dict[str, Any]:
    for name in optional:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.HasField("structured"):
        body.update(structured_body(request.structured))
    return body


def completions_body(request: gpb.CompleteRequest) -> dict[str, Any]:
    """The request as the streamed OpenAI completions body it means (unset optional fields left out, so they take
    their defaults)."""
    body: dict[str, Any] = {"model": request.model, "stream": True}  # tokens as they come, not paced
    which = request.WhichOneof("prompt")
    if which == "text":
        body["prompt"] = request.text
    elif which == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    return _common(body, request, _OPTIONAL)


def structured_body(s: gpb.StructuredOutputs) -> dict[str, Any]:
    """A constraint as the HTTP body's fields: ``response_format`` for JSON, ``structured_outputs`` for the rest.
    APIError(400) for a schema that is not JSON (the HTTP body would not have parsed)."""
    kind = s.WhichOneof("kind")
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}} if s.json_object else {}
    if kind == "json_schema":
        try:
            schema = json.loads(s.json_schema.schema)
        except json.JSONDecodeError as e:
            raise APIError(400, f"invalid JSON schema constraint: not valid JSON: {e}", "structured") from None
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "schema", "schema": schema, "strict": s.json_schema.strict}}}
    if kind == "choice":
        return {"structured_outputs": {"choice": list(s.choice.choices)}}
    if kind in ("regex", "grammar"):
        return {"structured_outputs": {kind: getattr(s, kind)}}
    return {}


def chat_body(request: gpb.ChatRequest) -> dict[str, Any]:
    """The request as the streamed OpenAI chat body it means. APIError(400) for a tool whose parameters are not
    JSON."""
    messages = []
    for m in request.messages:
        msg: dict[str, Any] = {"role": m.role}
        if m.HasField("content"):
            msg["content"] = m.content
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                               "arguments": c.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    body: dict[str, Any] = {"model": request.model, "stream": True, "messages": messages}
    _common(body, request, _SAMPLING)
    if request.HasField("top_logprobs"):
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs
    if request.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(request.tools)]
    choice = request.tool_choice.WhichOneof("choice")
    if choice == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif choice == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.function}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return body


def _tool(i: int, t: gpb.Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    if t.parameters:
        try:
            fn["parameters"] = json.loads(t.parameters)
        except json.JSONDecodeError as e:
            raise APIError(400, f"tools[{i}].parameters is not valid JSON: {e}", "tools") from None
    return {"type": "function", "function": fn}


def chat_chunk(request_id: str, deltas: list[dict[str, Any]]) -> gpb.ChatChunk:
    """One message for the OpenAI deltas (router/chat_output.py) a worker chunk made: content and reasoning
    joined, tool call pieces in order."""
    chunk = gpb.ChatChunk(request_id=request_id)
    for d in deltas:
        chunk.content += d.get("content") or ""
        chunk.reasoning_content += d.get("reasoning_content") or ""
        for call in d.get("tool_calls", ()):
            fn = call.get("function", {})
            chunk.tool_calls.append(gpb.ToolCallDelta(index=call["index"], id=call.get("id", ""),
                                                      name=fn.get("name", ""), arguments=fn.get("arguments", "")))
    return chunk


class GatewayServicer(gpb_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        keys = self.gateway.keys
        if not keys.enabled:
            return
        metadata = dict(context.invocation_metadata() or ())
        if keys.check(metadata.get("authorization")) is None:
            self.gateway.metrics.requests.labels(_PATH, "401").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "Incorrect or missing API key: send "
                                "'authorization: Bearer KEY' metadata")

    async def Models(self, request: gpb.ModelsRequest, context: grpc.aio.ServicerContext) -> gpb.ModelsResponse:
        await self._authenticate(context)
        cfg = self.gateway.config
        return gpb.ModelsResponse(models=[gpb.ModelInfo(id=cfg.model_name, max_model_len=cfg.max_model_len), *(
            gpb.ModelInfo(id=name, max_model_len=cfg.max_model_len, parent=cfg.model_name)
            for name in sorted(self.gateway.adapters()))])

    async def Complete(self, request: gpb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gpb.CompleteChunk]:
        def piece(req: GenerationRequest, c: Choice, text: str, start: int, start_lp: int) -> gpb.CompleteChunk:
            return gpb.CompleteChunk(request_id=req.request_id, text=text, token_ids=c.token_ids[start:],
                                     finish_reason=c.finish_reason or "", logprobs=c.logprobs[start_lp:])

        async for chunk in self._serve(request, context, False, _PATH, piece):
            yield chunk

    async def Chat(self, request: gpb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gpb.ChatChunk]:
        def piece(req: GenerationRequest, c: Choice, text: str, start: int, start_lp: int) -> gpb.ChatChunk:
            deltas, finish = chat_deltas(c, text, False)  # content, reasoning, tool calls; finish: tool_calls too
            chunk = chat_chunk(req.request_id, deltas)
            chunk.token_ids.extend(c.token_ids[start:])
            chunk.logprobs.extend(c.logprobs[start_lp:])
            chunk.finish_reason = finish or ""
            return chunk

        async for chunk in self._serve(request, context, True, _CHAT_PATH, piece):
            yield chunk

    async def _abort(self, context: grpc.aio.ServicerContext, e: APIError, path: str,
                     request: gpb.CompleteRequest | gpb.ChatRequest) -> None:
        self.gateway.metrics.requests.labels(path, str(e.status)).inc()
        name = field_name(e.param, request)
        await context.abort(status_for(e.status), f"{name}: {e.message}" if name else e.message,
                            trailing_metadata=(("tandem-error-field", name),) if name else ())

    async def _serve(self, request: Any, context: grpc.aio.ServicerContext, chat: bool, path: str,
                     piece: Callable[[GenerationRequest, Choice, str, int, int], Any]) -> AsyncIterator[Any]:
        gw = self.gateway
        t0 = time.perf_counter()
        await self._authenticate(context)
        admitted = contextlib.ExitStack()
        try:
            body = chat_body(request) if chat else completions_body(request)
            req = await gw.parse(body, chat, request.ByteSize())
            admitted.enter_context(gw.admitted())
        except APIError as e:
            await self._abort(context, e, path, request)
        with admitted:
            async for chunk in self._run(request, req, context, t0, path, piece):
                yield chunk

    async def _run(self, request: Any, req: GenerationRequest, context: grpc.aio.ServicerContext, t0: float,
                   path: str, piece: Callable[[GenerationRequest, Choice, str, int, int], Any]) -> AsyncIterator[Any]:
        gw = self.gateway
        metrics = gw.metrics
        metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        choice = new_choice(req, 0, gw.tokenizer) if req.chat else Choice(
            0, IncrementalDetokenizer(gw.tokenizer, tuple(req.params.stop), req.params.include_stop_str_in_output))
        gw.begin_trace([choice], t0)
        plans: list[Plan] = []
        sent_tokens = sent_logprobs = 0
        first = True
        try:
            async with contextlib.aclosing(gw.choice_texts(req, choice, plans)) as texts:
                async for text in texts:
                    chunk = piece(req, choice, text, sent_tokens, sent_logprobs)
                    sent_tokens, sent_logprobs = len(choice.token_ids), len(choice.logprobs)
                    if choice.finish_reason:
                        chunk.usage.CopyFrom(gpb.Usage(prompt_tokens=len(req.prompt_token_ids),
                                                       completion_tokens=len(choice.token_ids),
                                                       cached_tokens=choice.cached))
                    if first:
                        metrics.ttft.labels(plans[0].mode if plans else "unknown").observe(time.perf_counter() - t0)
                        first = False
                    yield chunk
        except APIError as e:
            await self._abort(context, e, path, request)
        metrics.e2e.observe(time.perf_counter() - t0)
        gw.request_done(len(req.prompt_token_ids), [choice], t0, plans, path.removeprefix("grpc:"))
        metrics.requests.labels(path, "200").inc()


async def start_grpc_gateway(gateway: Gateway, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve the gRPC API on ``host:port`` (0: a free port) in the running event loop; returns the server and
    the bound port. Stop it with ``await server.stop(grace)``."""
    server = grpc.aio.server()
    gpb_grpc.add_GatewayServicer_to_server(GatewayServicer(gateway), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind the gRPC gateway to {host}:{port}")
    await server.start()
    return server, bound
