"""A fake worker: the Worker gRPC API with no engine behind it, for measuring the router's own overhead only.

It is a stand-in backend for ``tandem bench gateway`` and its test, never for serving: ``Generate`` answers every
request at once with ``--tokens`` canned token ids (``--first-token``, ``--first-token + 1``, ...; fewer if the
request's ``max_tokens`` is smaller), ``--tokens-per-chunk`` per streamed chunk (or the request's
``min_chunk_tokens`` when that is larger, as a real worker holds tokens for such a request), the last chunk
finishing with ``length``. Nothing is computed, cached or checked, so whatever time a client sees beyond a direct
``Generate`` on this process is the router's.

``Session`` answers the same way, every request of a message in one reply, on the gRPC call and on a plain-TCP
session port (length-prefixed frames, ``wire/framing.py``; named in ``Health`` as a real worker names its own,
unless ``--no-tcp-session``). What the router's pool needs is
answered too: ``Health`` (SERVING, role ``both``), ``Load`` (all zeros), ``Snapshot`` (an empty cache at sequence
0) and ``KVEvents`` (a stream that stays open and sends nothing). ``Abort`` finds nothing; ``Drain`` marks the
worker draining. ``Reserve``, ``Prefill`` and ``Decode`` are UNIMPLEMENTED: with
no prefill worker every request runs colocated.

Run: ``python -m bench.fake_worker --port 0 --tokens 8``; prints ``READY <port>`` once it serves, stops on
SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.serve import stop_on_signals
from wire.framing import FrameBuffer, FrameError, frame, tune_session_socket

_UNAVAILABLE: int = grpc.StatusCode.UNAVAILABLE.value[0]


@dataclass(slots=True, frozen=True)
class FakeConfig:
    tokens: int = 8
    tokens_per_chunk: int = 1
    first_token: int = 300
    role: str = "both"
    worker_id: str = ""
    tcp_session: bool = True  # also serve the plain-TCP Session transport (and name its port in Health)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.tokens_per_chunk < 1 or self.first_token < 0:
            raise ValueError(f"tokens and tokens_per_chunk must be >= 1 and first_token >= 0, got {self}")
        if self.role not in ("both", "decode"):
            raise ValueError(f"a fake worker serves role both or decode, got {self.role!r}")


class FakeWorker(pb_grpc.WorkerServicer):
    """Answers from prebuilt messages: one chunk list per answer length, built on first use."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"fake-{uuid.uuid4().hex[:8]}"
        self.draining = False
        self._chunks: dict[tuple[int, int], tuple[pb.TokenChunk, ...]] = {}
        self._closed = asyncio.Event()
        self.session_port = 0  # its plain-TCP Session transport (_TcpSession), once listening

    def chunks(self, n: int, min_chunk_tokens: int = 0) -> tuple[pb.TokenChunk, ...]:
        """The chunks of an ``n``-token answer, at least ``min_chunk_tokens`` per chunk but the last."""
        step = max(self.config.tokens_per_chunk, min_chunk_tokens)
        out = self._chunks.get((n, step))
        if out is None:
            first = self.config.first_token
            ids = list(range(first, first + n))
            out = tuple(pb.TokenChunk(token_ids=ids[i:i + step], finish_reason="length" if i + step >= n else "")
                        for i in range(0, n, step))
            self._chunks[n, step] = out
        return out

    def close(self) -> None:
        self._closed.set()

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenChunk]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        want = request.params.max_tokens
        n = min(want, self.config.tokens) if want else self.config.tokens
        for chunk in self.chunks(n, request.min_chunk_tokens):
            yield chunk

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SessionReply]:
        async for msg in request_iterator:
            reply = self.answer(msg)
            if reply is not None:
                yield reply

    def answer(self, msg: pb.SessionRequest) -> pb.SessionReply | None:
        """Every request of a message answered in one reply, as Generate answers at once (None: only aborts)."""
        out: list[pb.SessionChunk] = []
        for g in msg.generate:
            if self.draining:
                out.append(pb.SessionChunk(request_id=g.request_id, error_code=_UNAVAILABLE,
                                           error=f"worker {self.worker_id} is draining"))
                continue
            want = g.params.max_tokens
            n = min(want, self.config.tokens) if want else self.config.tokens
            rid = g.request_id
            out.extend(pb.SessionChunk(request_id=rid, chunk=c) for c in self.chunks(n, g.min_chunk_tokens))
        return pb.SessionReply(chunks=out) if out else None

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=False)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(status="SERVING", role=self.config.role, model="fake", draining=self.draining,
                                 worker_id=self.worker_id, kv_backend="none", session_port=self.session_port)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return pb.LoadResponse()

    async def Snapshot(self, request: pb.SnapshotRequest,
                       context: grpc.aio.ServicerContext) -> pb.SnapshotResponse:
        return pb.SnapshotResponse(worker_id=self.worker_id, seq=0)

    async def KVEvents(self, request: pb.KVEventsRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KVEventBatch]:
        await self._closed.wait()  # nothing is ever cached, so there is never an event
        return
        yield  # an async generator that yields nothing

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        self.draining = True
        return pb.DrainResponse(in_flight=0)


class _TcpSession(asyncio.Protocol):
    """The fake's side of the plain-TCP Session transport (wire/framing.py), as a worker's SessionListener."""

    def __init__(self, service: FakeWorker) -> None:
        self.service = service
        self.frames = FrameBuffer()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_session_socket(sock)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        try:
            msgs = [pb.SessionRequest.FromString(f) for f in self.frames.feed(data)]
        except (FrameError, DecodeError):
            self.transport.close()
            return
        out = [reply.SerializeToString() for m in msgs if (reply := self.service.answer(m)) is not None]
        if out:
            self.transport.write(b"".join(frame(o) for o in out))


async def serve(config: FakeConfig, host: str, port: int) -> int:
    service = FakeWorker(config)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_WorkerServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        print(f"error: could not bind {host}:{port}", file=sys.stderr)
        return 2
    await server.start()
    if config.tcp_session:
        tcp = await asyncio.get_running_loop().create_server(lambda: _TcpSession(service), host, 0)
        service.session_port = tcp.sockets[0].getsockname()[1]
    gc.freeze()
    print(f"READY {bound}", flush=True)
    stop = stop_on_signals()
    await stop.wait()
    service.close()
    await server.stop(0.5)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the READY line)")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--first-token", type=int, default=300)
    p.add_argument("--role", default="both", choices=["both", "decode"])
    p.add_argument("--worker-id", default="")
    p.add_argument("--no-tcp-session", action="store_true", help="serve the Session stream on gRPC only")
    args = p.parse_args(argv)
    try:
        config = FakeConfig(args.tokens, args.tokens_per_chunk, args.first_token, args.role, args.worker_id,
                            not args.no_tcp_session)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
