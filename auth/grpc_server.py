"""The server side: bind with mutual TLS when configured, and refuse admin RPCs that lack the cluster token.

``AdminGuard`` (a ``grpc.server`` interceptor) and ``AioAdminGuard`` (``grpc.aio.server``) check only the methods
they are given; every other RPC passes untouched, at the cost of one set lookup per call. A caller without the
token, or with another, gets ``UNAUTHENTICATED``; a server that holds no token refuses those methods to everyone
with ``PERMISSION_DENIED`` (nobody could prove they belong to the cluster).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from auth.credentials import Credentials
from auth.tls import grpc_server_credentials
from auth.token import METADATA_KEY, token_matches

# The worker API's admin RPCs: draining a worker, reading its cache (Snapshot, KVEvents: which prefixes are cached),
# aborting any request by id, loading or unloading a LoRA adapter (it reads a directory on the worker's host).
WORKER_ADMIN_METHODS = frozenset(f"/tandem.v1.Worker/{m}" for m in ("Drain", "Snapshot", "Abort", "KVEvents",
                                                                     "LoadLoRAAdapter", "UnloadLoRAAdapter"))
# The controller's API (proto/tandem/v1/control.proto): changing replicas or draining them.
CONTROL_ADMIN_METHODS = frozenset(f"/tandem.v1.Control/{m}" for m in ("SetReplicas", "Drain"))


def refusal(token: str | None, metadata: Iterable[tuple[str, Any]] | None) -> tuple[grpc.StatusCode, str] | None:
    """Why a call with ``metadata`` is refused by a server holding ``token``, or None if it may go on."""
    if token is None:
        return grpc.StatusCode.PERMISSION_DENIED, "admin RPCs are refused: this server holds no cluster token"
    presented = next((str(v) for k, v in metadata or () if k == METADATA_KEY), None)
    if presented is None:
        return grpc.StatusCode.UNAUTHENTICATED, "this RPC needs the cluster token (authorization: Bearer ...)"
    if not token_matches(presented, token):
        return grpc.StatusCode.UNAUTHENTICATED, "wrong cluster token"
    return None


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, why)

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse, **kw)


def _aio_refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, why)

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse, **kw)


class AdminGuard(grpc.ServerInterceptor):
    def __init__(self, token: str | None, methods: frozenset[str] = WORKER_ADMIN_METHODS) -> None:
        self.token = token
        self.methods = methods

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:  # type: ignore[attr-defined]
            return handler
        why = refusal(self.token, handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        return handler if why is None else _refusing(handler, *why)


class AioAdminGuard(grpc.aio.ServerInterceptor):
    def __init__(self, token: str | None, methods: frozenset[str] = WORKER_ADMIN_METHODS) -> None:
        self.token = token
        self.methods = methods

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:  # type: ignore[attr-defined]
            return handler
        why = refusal(self.token, handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        return handler if why is None else _aio_refusing(handler, *why)


def add_port(server: Any, address: str, creds: Credentials) -> int:
    """Bind ``server`` (``grpc.server`` or ``grpc.aio.server``) on ``address``: mutual TLS with ``creds.tls``,
    plaintext without. Returns the bound port (0 when the address could not be bound)."""
    if creds.tls is None:
        port: int = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, grpc_server_credentials(creds.tls))
    return port
