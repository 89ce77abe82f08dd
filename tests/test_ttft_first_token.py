"""TTFT never waits on the KV transfer: the router streams prefill's first token to the client when ``Prefill``
returns, and decode's stream continues from the second token.

Real ``tandem worker`` processes (prefill and decode, KV over TCP) behind an in-process router serving HTTP on
loopback. The prefill worker's fault injection (``--debug-transfer-delay-ms 500``) holds each transfer's last
layer back for 500 ms after the first token was sampled, so decode cannot start before then.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import RouterThread

from engine.tokenizer import Tokenizer
from router.server import RouterConfig
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "256", "--threads", "1"]
DELAY_S = 0.5


def test_first_sse_chunk_arrives_before_decode_starts_and_the_stream_stays_exact(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """A 120-token prompt, routed disaggregated, streamed: the first SSE chunk (prefill's token) arrives at least
    ~500 ms before the second (decode's first), which cannot come before the delayed transfer lands. The whole
    text equals transformers' greedy continuation."""
    path = checkpoint("llama")
    prefill = start_worker("prefill", str(path), "tcp", [*FLAGS, "--debug-transfer-delay-ms", str(DELAY_S * 1000)])
    decode = start_worker("decode", str(path), "tcp", FLAGS)
    rt = RouterThread(RouterConfig(model=str(path), workers=(prefill.address, decode.address)))
    try:
        prompt = [random.Random(120).randrange(1, 2000) for _ in range(120)]
        n = 12
        arrivals: list[tuple[float, dict[str, Any]]] = []
        t0 = time.monotonic()
        with httpx.stream("POST", rt.url + "/v1/completions", timeout=120, headers={"x-tandem-explain": "1"},
                          json={"model": path.name, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            assert "prefill[" in r.headers["x-tandem-route"], r.headers["x-tandem-route"]
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append((time.monotonic() - t0, json.loads(line[6:])))
        ref = hf_greedy(path, prompt, n)
        tok = Tokenizer(path)
        text = "".join(c["choices"][0]["text"] for _, c in arrivals)
        assert text == tok.decode(ref)
        assert arrivals[-1][1]["choices"][0]["finish_reason"] == "length"
        first_at, second_at = arrivals[0][0], arrivals[1][0]
        print(f"first SSE chunk at {first_at * 1000:.0f} ms, decode's first at {second_at * 1000:.0f} ms")
        # Decode's stream starts only once the transfer landed, >= DELAY_S after prefill sampled the first token:
        # the first chunk came well before it.
        assert second_at - first_at >= DELAY_S * 0.8, (first_at, second_at)
    finally:
        rt.stop()
        prefill.stop()
        decode.stop()
