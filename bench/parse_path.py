"""The gateway's per-request Python work in process, without HTTP: parsing and validating a request body
(``Gateway.parse_body``: JSON, checks, tokenising) and the ASGI app's own handling around a handler that answers at
once (``router/asgi.py``: headers, body read under its timeout, the disconnect watcher's timer, the response).

Why: under ``tandem bench gateway`` these costs hide among the HTTP server's, the session's and the client's, on
a machine whose load moves the totals by 2×; here each is timed alone, in CPU seconds of this process (so other
processes on the machine disturb it far less than wall time), best of ``--repeat`` runs. ``--tree DIR`` imports
the router from another checkout (e.g. ``git archive HEAD router engine proto auth | tar -x -C /tmp/old``), so
two trees can be compared in alternation on the same machine.

    python -m bench.parse_path --model ~/.cache/tandem/tiny-llama [--tree DIR] [--n 20000] [--repeat 5] [--body NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

BODIES: dict[str, tuple[bool, dict[str, Any]]] = {
    "completion": (False, {"model": "m", "prompt": "Hello, Tandem", "max_tokens": 8, "temperature": 0}),
    "completion_stream": (False, {"model": "m", "prompt": "Hello, Tandem", "max_tokens": 8, "temperature": 0,
                                  "stream": True, "stream_options": {"include_usage": True}}),
    "chat": (True, {"model": "m", "messages": [{"role": "user", "content": "Hello, Tandem"}], "max_tokens": 8,
                    "temperature": 0.7, "top_p": 0.9}),
}


def _cpu_us(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Best-of-``repeat`` CPU µs per call of ``fn`` over ``n`` calls (after a warm-up of ``n // 10``)."""
    for _ in range(n // 10):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def parse_costs(model: str, n: int, repeat: int, bodies: list[str]) -> dict[str, float]:
    from engine.tokenizer import Tokenizer
    from router.gateway import Gateway

    tok = Tokenizer(model)
    gw = Gateway.__new__(Gateway)  # parse_body needs only the config and the tokenizer
    from router.gateway import GatewayConfig

    gw.config = GatewayConfig("m", 2048, tok.vocab_size)
    gw.tokenizer = tok
    out = {}
    for name in bodies:
        chat, body = BODIES[name]
        raw = json.dumps(body).encode()
        out[f"parse_{name}_us"] = _cpu_us(functools.partial(gw.parse_body, raw, chat), n, repeat)
    return out


def asgi_cost(n: int, repeat: int) -> float:
    from router.asgi import ASGIApp, HTTPConfig, Request, Response

    async def handler(request: Request) -> Response:
        return Response(b'{"ok":true}')

    app = ASGIApp(handler, HTTPConfig(), lambda path, status: None, watch=frozenset({"/v1/completions"}))
    body = json.dumps(BODIES["completion"][1]).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    msg = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return msg

    async def send(message: dict[str, Any]) -> None:
        pass

    async def requests(count: int) -> None:
        for _ in range(count):
            await app(scope, receive, send)

    async def best() -> float:
        await requests(n // 10)
        runs = []
        for _ in range(repeat):
            t0 = time.process_time()
            await requests(n)
            runs.append(time.process_time() - t0)
        await asyncio.sleep(0.1)  # the cancelled timers' handles leave the loop's heap
        return min(runs) / n * 1e6

    return asyncio.run(best())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tree", default=None, help="import the router from this directory instead")
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--body", action="append", choices=sorted(BODIES), help="time only these bodies (default: all)")
    args = p.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    out: dict[str, Any] = dict(parse_costs(args.model, args.n, args.repeat, args.body or list(BODIES)))
    out["asgi_app_us"] = asgi_cost(args.n, args.repeat)
    import router

    out["tree"] = str(router.__file__)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
