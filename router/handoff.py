"""The disaggregated handoff, from the caller's side: Reserve on decode, Prefill with that destination, Decode.

Every step is bounded by the lease and by gRPC deadlines. On any failure the caller aborts the request on both
workers, so no blocks stay reserved, and the error names the step that failed. ``HandoffError.retryable`` says
whether another worker pair could succeed (worker death, overload) or not (bad input).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from auth.credentials import Credentials
from auth.grpc_client import attach
from auth.grpc_client import channel as auth_channel
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.dispatch import first_chunk

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED}


class HandoffError(RuntimeError):
    def __init__(self, step: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{step} failed ({code.name}): {details}")
        self.step = step
        self.code = code
        self.details = details

    @property
    def retryable(self) -> bool:
        return self.code in _RETRYABLE


@dataclass(slots=True)
class WorkerClient:
    address: str
    channel: grpc.Channel
    stub: pb_grpc.WorkerStub

    @classmethod
    def connect(cls, address: str, creds: Credentials | None = None) -> WorkerClient:
        """A client with ``creds`` (default: this process's cluster token, no TLS): Abort needs the token."""
        creds = creds if creds is not None else Credentials.for_cluster()
        channel = auth_channel(address, creds, options=[("grpc.max_receive_message_length", 64 << 20)])
        return cls(address, channel, attach(pb_grpc.WorkerStub(channel), creds))

    def close(self) -> None:
        self.channel.close()


def _abort(client: WorkerClient, request_id: str) -> None:
    with contextlib.suppress(grpc.RpcError):  # a dead worker's blocks went with it
        client.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=2.0)


def disaggregated_generate(prefill: WorkerClient, decode: WorkerClient, request_id: str, prompt: list[int],
                           params: pb.SamplingParams, lease_ms: int = 30_000,
                           rpc_timeout_s: float = 120.0, min_chunk_tokens: int = 0) -> Iterator[pb.TokenChunk]:
    """Yield the request's token chunks: the first, yielded as soon as ``Prefill`` returns, is the prefill-sampled
    token (TTFT never waits on the transfer); decode's stream follows from the second token. ``min_chunk_tokens``:
    the decode worker's output pacing (worker.proto), for a caller that only wants the whole answer."""
    wire = params
    step = "Reserve"
    try:
        reserve = decode.stub.Reserve(pb.ReserveRequest(request_id=request_id, prompt_token_ids=prompt,
                                                        params=wire, lease_ms=lease_ms),
                                      timeout=rpc_timeout_s)
        step = "Prefill"
        first = prefill.stub.Prefill(pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, params=wire,
                                                       destination=reserve.destination, lease_ms=lease_ms),
                                     timeout=rpc_timeout_s)
        step = "Decode"
        dreq = pb.DecodeRequest(request_id=request_id, first_token_id=first.first_token_id,
                                min_chunk_tokens=min_chunk_tokens, first_token_sent=True)
        if first.HasField("first_logprob"):
            dreq.first_logprob.CopyFrom(first.first_logprob)
        yield first_chunk(first, len(prompt))
        for chunk in decode.stub.Decode(dreq, timeout=rpc_timeout_s):
            if not chunk.num_cached_tokens:
                chunk.num_cached_tokens = first.num_cached_tokens
            yield chunk
    except grpc.RpcError as e:
        _abort(decode, request_id)
        _abort(prefill, request_id)
        raise HandoffError(step, e.code(), e.details() or "") from None
