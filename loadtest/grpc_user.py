"""A locust user calling Tandem's client gRPC API, ``tandem.v1.Gateway/Complete``, a stream per completion.

It uses the published client stubs (``proto/tandem/v1/gateway_pb2*``: generated code, no logic; what any gRPC
client of Tandem imports), never Tandem's internals. gRPC's gevent integration is initialised before any channel
exists, as locust runs users as greenlets. The stream's first text is TTFT, the gaps between messages ITL, its end
E2E (report.py); a call that ends in an error status, or with no text, is a failure.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, task
from report import StreamTimer
from scenarios import make_request

grpc_gevent.init_gevent()  # before any channel is made

try:
    from proto.tandem.v1 import gateway_pb2 as gpb
    from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
except ImportError:  # run from a checkout: the stubs sit beside loadtest/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from proto.tandem.v1 import gateway_pb2 as gpb
    from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc


def grpc_target(host: str, explicit: str | None) -> str:
    """``--grpc-target`` if given, else the HTTP host's port + 1 (where ``tandem up`` serves gRPC)."""
    if explicit:
        return explicit
    u = urlparse(host)
    return f"{u.hostname or '127.0.0.1'}:{(u.port or 8000) + 1}"


class GatewayUser(User):
    abstract = True

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        assert opts is not None and self.host is not None
        self.rng = random.Random()
        self.channel = grpc.insecure_channel(grpc_target(self.host, opts.grpc_target))
        self.stub = gpb_grpc.GatewayStub(self.channel)
        self.model = opts.model or self.stub.Models(gpb.ModelsRequest(), timeout=30).models[0].id

    def on_stop(self) -> None:
        self.channel.close()

    def _fail(self, name: str, start: float, exc: BaseException) -> None:
        self.environment.events.request.fire(request_type="grpc", name=name,
                                             response_time=(time.perf_counter() - start) * 1000.0,
                                             response_length=0, exception=exc, context={})

    @task
    def complete(self) -> None:
        opts = self.environment.parsed_options
        assert opts is not None
        req = make_request(opts.scenario, self.rng, opts.long_words)
        text = f"{req.system}\n\n{req.prompt}" if req.system else req.prompt  # Complete takes plain text
        name = f"Gateway/Complete [{opts.scenario}]"
        timer = StreamTimer(self.environment, name)
        call: Any = self.stub.Complete(gpb.CompleteRequest(model=self.model, text=text, max_tokens=opts.max_tokens,
                                                           ignore_eos=True, temperature=0), timeout=120)
        chars = 0
        try:
            for chunk in call:
                if chunk.text or chunk.token_ids:
                    timer.chunk()
                    chars += len(chunk.text)
        except grpc.RpcError as e:
            self._fail(name, timer.start, e)
            return
        if not timer.chunks:
            self._fail(name, timer.start, RuntimeError("the stream carried no tokens"))
            return
        timer.done()
        self.environment.events.request.fire(request_type="grpc", name=name,
                                             response_time=(time.perf_counter() - timer.start) * 1000.0,
                                             response_length=chars, exception=None, context={})
