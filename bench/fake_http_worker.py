"""A fake OpenAI-compatible HTTP backend, for measuring a peer router (sglang-router) the way ``bench.fake_worker``
measures Tandem's: no engine, every completion answered at once with ``--tokens`` canned tokens.

Peer routers speak HTTP to their workers, so this is the same stand-in as ``bench.fake_worker`` on their protocol:
``POST /v1/completions`` (and ``/generate``) answers ``tokens`` tokens of text, as one JSON body or as one SSE event
per token (usage last when asked for), finish reason ``length``; the start-up and health probes a router makes
(``/health``, ``/health_generate``, ``/get_server_info``, ``/get_model_info``, ``/v1/models``) are answered too.
It runs on the gateway's own HTTP stack (router/asgi.py on granian, router/http_server.py), in one process.

Run: ``python -m bench.fake_http_worker --port 0 --tokens 8``; prints ``READY <port>``, stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

import orjson

from router.asgi import ASGIApp, HTTPConfig, Request, Response, StreamResponse
from router.http_server import HTTPServer
from router.serve import stop_on_signals

_WORDS = [f" w{i}" for i in range(64)]


class FakeHTTPWorker:
    def __init__(self, tokens: int, model: str, model_path: str = "") -> None:
        self.tokens = tokens
        self.model = model
        # A local checkpoint directory: a router that loads the tokenizer the worker reports finds it on disk.
        path = model_path or model
        self.info = orjson.dumps({"model_path": path, "tokenizer_path": path, "is_generation": True,
                                  "served_model_name": model, "max_total_num_tokens": 1 << 20})
        self.models = orjson.dumps({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                                "owned_by": "fake"}]})

    async def handle(self, req: Request) -> Response | StreamResponse:
        path = req.path
        if req.method == "GET":
            if path in ("/health", "/health_generate", "/ping"):
                return Response(b"", content_type="text/plain")
            if path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
                return Response(self.info)
            if path == "/v1/models":
                return Response(self.models)
            return Response(b'{"error":"not found"}', status=404)
        if path not in ("/v1/completions", "/generate"):
            return Response(b'{"error":"not found"}', status=404)
        try:
            body = orjson.loads(req.body) if req.body else {}
        except orjson.JSONDecodeError:
            return Response(b'{"error":"bad json"}', status=400)
        n = int(body.get("max_tokens") or (body.get("sampling_params") or {}).get("max_new_tokens") or self.tokens)
        n = min(n, self.tokens)
        usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
        rid = f"cmpl-fake-{time.monotonic_ns()}"
        if not body.get("stream"):
            text = "".join(_WORDS[i % len(_WORDS)] for i in range(n))
            return Response(orjson.dumps({"id": rid, "object": "text_completion", "created": 0, "model": self.model,
                                          "choices": [{"index": 0, "text": text, "logprobs": None,
                                                       "finish_reason": "length"}], "usage": usage}))
        resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(req)
        events = []
        for i in range(n):
            events.append(b"data: " + orjson.dumps({
                "id": rid, "object": "text_completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "text": _WORDS[i % len(_WORDS)], "logprobs": None,
                             "finish_reason": "length" if i == n - 1 else None}]}) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(b"data: " + orjson.dumps({"id": rid, "object": "text_completion", "created": 0,
                                                    "model": self.model, "choices": [], "usage": usage}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        await resp.write(b"".join(events))  # every event at once: one ASGI send, as a fast backend would
        await resp.write_eof()
        return resp


async def serve(tokens: int, model: str, model_path: str, host: str, port: int) -> int:
    config = HTTPConfig()
    server = HTTPServer(ASGIApp(FakeHTTPWorker(tokens, model, model_path).handle, config, lambda path, status: None),
                        config)
    bound = await server.start(host, port)
    print(f"READY {bound}", flush=True)
    stop = stop_on_signals()
    await stop.wait()
    await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--model", default="tiny-llama", help="the served model name")
    p.add_argument("--model-path", default="", help="checkpoint directory reported to the router (its tokenizer)")
    args = p.parse_args(argv)
    if args.tokens < 1:
        print("error: --tokens must be >= 1", file=sys.stderr)
        return 2
    return asyncio.run(serve(args.tokens, args.model, args.model_path, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
