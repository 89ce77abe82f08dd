"""The router's client-facing gRPC API (``proto/tandem/v1/gateway.proto``), beside the OpenAI HTTP gateway.

One ``Complete`` call::

    CompleteRequest ──as an OpenAI completions body──► parse_request (the HTTP gateway's validation, tokenizer)
        ──Gateway.admit──► Gateway.choice_texts (dispatcher: routing, retries, migration, detokenizer, stops)
        ──► CompleteChunk per worker chunk (new text, new token ids, new logprobs) ... last: finish_reason + usage

Everything after the request is parsed is the HTTP path's own code, so both APIs give the same tokens, text and
errors for the same request. A cancelled call (client gone, deadline) cancels the handler, which aborts the
request on every worker it reached, as a dropped HTTP connection does.

With API keys configured (auth/api_keys.py), every call carries ``authorization: Bearer KEY`` metadata; a missing
or bad key gets ``UNAUTHENTICATED``. A call holds an admission slot (router/admission.py) from its first chunk to
its last; beyond the bound it gets ``RESOURCE_EXHAUSTED``, as HTTP gets 429.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine.detokenizer import IncrementalDetokenizer
from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from router.dispatch import Plan
from router.gateway import Choice, Gateway
from router.openai_protocol import APIError, GenerationRequest

log = logging.getLogger(__name__)

_PATH = "grpc:/tandem.v1.Gateway/Complete"
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "min_tokens", "logprobs")


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


def completions_body(request: gpb.CompleteRequest) -> dict[str, Any]:
    """The request as the streamed OpenAI completions body it means (unset optional fields left out, so they take
    their defaults)."""
    body: dict[str, Any] = {"model": request.model, "stream": True}  # tokens as they come, not paced
    which = request.WhichOneof("prompt")
    if which == "text":
        body["prompt"] = request.text
    elif which == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    for name in _OPTIONAL:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.ignore_eos:
        body["ignore_eos"] = True
    return body


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
        return gpb.ModelsResponse(models=[gpb.ModelInfo(id=cfg.model_name, max_model_len=cfg.max_model_len)])

    async def Complete(self, request: gpb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gpb.CompleteChunk]:
        gw = self.gateway
        metrics = gw.metrics
        t0 = time.perf_counter()
        await self._authenticate(context)
        admitted = contextlib.ExitStack()
        try:
            req = await gw.parse(completions_body(request), False, request.ByteSize())
            admitted.enter_context(gw.admitted())
        except APIError as e:
            metrics.requests.labels(_PATH, str(e.status)).inc()
            await context.abort(status_for(e.status), e.message)
        with admitted:
            async for chunk in self._complete(req, context, t0):
                yield chunk

    async def _complete(self, req: GenerationRequest, context: grpc.aio.ServicerContext,
                        t0: float) -> AsyncIterator[gpb.CompleteChunk]:
        gw = self.gateway
        metrics = gw.metrics
        metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        choice = Choice(0, IncrementalDetokenizer(gw.tokenizer, tuple(req.params.stop),
                                                  req.params.include_stop_str_in_output))
        plans: list[Plan] = []
        sent_tokens = sent_logprobs = 0
        first = True
        try:
            async with contextlib.aclosing(gw.choice_texts(req, choice, plans)) as texts:
                async for text in texts:
                    chunk = gpb.CompleteChunk(request_id=req.request_id, text=text,
                                              token_ids=choice.token_ids[sent_tokens:],
                                              finish_reason=choice.finish_reason or "",
                                              logprobs=choice.logprobs[sent_logprobs:])
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
            metrics.requests.labels(_PATH, str(e.status)).inc()
            await context.abort(status_for(e.status), e.message)
        metrics.e2e.observe(time.perf_counter() - t0)
        gw.request_done(len(req.prompt_token_ids), [choice], t0, plans, "/tandem.v1.Gateway/Complete")
        metrics.requests.labels(_PATH, "200").inc()


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
