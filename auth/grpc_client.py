"""The client side: a channel with the process's credentials, and a stub whose every call carries the token.

Use ``aio_channel`` / ``channel`` where a worker channel is opened (TLS when the credentials hold TLS files) and
``attach`` on the stub built from it::

    ch = aio_channel(address, creds, options)
    stub = attach(pb_grpc.WorkerStub(ch), creds)
    await stub.Drain(pb.DrainRequest())        # carries authorization: Bearer <token>

The token rides on each call as metadata, merged with any the caller passes. gRPC's own call credentials would do
the same through a Python plugin run per call on another thread, and gRPC refuses to send them at all on a
channel without TLS, which loopback ``tandem up`` uses; a wrapped multicallable costs one function call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import grpc

from auth.credentials import Credentials
from auth.tls import grpc_channel_credentials, grpc_channel_options

S = TypeVar("S")
Options = Sequence[tuple[str, Any]]


class _WithMetadata:
    """A multicallable that adds the token to every call's metadata."""

    __slots__ = ("_call", "_metadata")

    def __init__(self, call: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._call = call
        self._metadata = metadata

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        extra = kwargs.get("metadata")
        kwargs["metadata"] = self._metadata if not extra else (*self._metadata, *extra)
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # with_call, future (sync unary multicallables)
        attr = getattr(self._call, name)
        return _WithMetadata(attr, self._metadata) if callable(attr) and name in ("with_call", "future") else attr


def attach(stub: S, creds: Credentials) -> S:
    """``stub`` with every RPC method sending ``creds``' token (``stub`` itself, unchanged, without a token)."""
    md = creds.metadata
    if not md:
        return stub
    for name, value in list(vars(stub).items()):
        if callable(value) and not name.startswith("_"):
            setattr(stub, name, _WithMetadata(value, md))
    return stub


def aio_channel(address: str, creds: Credentials, options: Options = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address``: mutual TLS with ``creds.tls``, plaintext without."""
    if creds.tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, grpc_channel_credentials(creds.tls),
                                   options=[*options, *grpc_channel_options(creds.tls)])


def channel(address: str, creds: Credentials, options: Options = ()) -> grpc.Channel:
    """The blocking counterpart of ``aio_channel``."""
    if creds.tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, grpc_channel_credentials(creds.tls),
                               options=[*options, *grpc_channel_options(creds.tls)])
