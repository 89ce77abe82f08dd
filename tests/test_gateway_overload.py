"""Overload sheds at the door (issue 24 §4): 1,000 concurrent streams against 2 real ``tandem worker`` processes
(colocated, the built-in tiny model) behind a ``python -m router.serve`` process on these 2 cores. Admission lets
32 requests per worker in; every other request gets 429 with ``Retry-After`` at once. Every admitted request
completes with transformers' greedy text, no live worker is cut off (the router's ``tandem_router_worker_cutoffs``),
every 429 is counted (``tandem_admission_rejected``), and once the load ends the workers hold no block (``Load``).
The admitted requests' TTFT p50/p99 is printed, as the client saw it (one asyncio client in this process opening
1,000 connections at once: its own queueing is in it) and as the router measured it (its TTFT histogram)."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from gateway_harness import WORKER_FLAGS, wait_idle

from engine.tokenizer import Tokenizer
from router.serve import ReadyProcess
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
STREAMS = 1000
PER_WORKER = 32
MAX_TOKENS = 8
PROMPTS = [[(11 * i + 3 * j) % 400 + 5 for j in range(8 + i)] for i in range(8)]


async def _one(client: httpx.AsyncClient, model: str, i: int) -> tuple[int, str, float, str | None]:
    """(status, text, TTFT, Retry-After) of one streamed request."""
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = 0.0
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, 0.0, r.headers.get("retry-after")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    return 500, str(chunk["error"]), 0.0, None
                if not ttft:
                    ttft = time.perf_counter() - t0
                text += "".join(c["text"] for c in chunk["choices"])
    return 200, text, ttft, None


def _metric(text: str, name: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]


def _hist_quantile(text: str, q: float) -> str:
    """The bucket bound holding quantile ``q`` of ``tandem_ttft_seconds`` (every mode together)."""
    buckets: Counter[str] = Counter()
    for m in re.finditer(r'^tandem_ttft_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        buckets[m.group(1)] += int(float(m.group(2)))
    total = buckets["+Inf"]
    for le, n in sorted(buckets.items(), key=lambda kv: float(kv[0])):
        if n >= q * total:
            return le
    return "+Inf"


def test_1000_concurrent_streams_complete_exactly_or_get_429_and_no_live_worker_is_cut_off(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    path = checkpoint("llama")
    tokenizer = Tokenizer(path)
    ref = [tokenizer.decode(hf_greedy(path, p, MAX_TOKENS)) for p in PROMPTS]
    workers = [start_worker("decode", str(path), "tcp", [*WORKER_FLAGS, "--worker-id", f"ovl-{i}"]) for i in range(2)]
    router = None
    try:
        router = ReadyProcess.start("router", [sys.executable, "-m", "router.serve", "--model", str(path), "--workers",
                                               ",".join(w.address for w in workers), "--port", "0",
                                               "--max-requests-per-decode-worker", str(PER_WORKER)])
        url = f"http://127.0.0.1:{router.port}"
        for i in range(4):  # warm both workers (first batch shapes) before the clock starts
            warm = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": path.name, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0})
            assert warm.status_code == 200, warm.text

        async def load() -> list[tuple[int, str, float, str | None]]:
            limits = httpx.Limits(max_connections=STREAMS + 16, max_keepalive_connections=STREAMS + 16)
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
                return list(await asyncio.gather(*(_one(client, path.name, i) for i in range(STREAMS))))

        t0 = time.monotonic()
        results = asyncio.run(asyncio.wait_for(load(), 600))
        took = time.monotonic() - t0
        statuses = Counter(r[0] for r in results)
        assert set(statuses) <= {200, 429}, [r for r in results if r[0] not in (200, 429)][:3]
        wrong = [(i, r[1]) for i, r in enumerate(results) if r[0] == 200 and r[1] != ref[i % len(PROMPTS)]]
        assert not wrong, wrong[:3]
        assert all(r[3] is not None and int(r[3]) >= 1 for r in results if r[0] == 429)
        assert statuses[200] >= 2 * PER_WORKER
        ttfts = sorted(r[2] for r in results if r[0] == 200)
        p50, p99 = ttfts[len(ttfts) // 2], ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))]
        print(f"\n{STREAMS} streams in {took:.1f} s: {statuses[200]} completed token-exact, {statuses[429]} got 429; "
              f"admitted TTFT p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms")
        metrics = httpx.get(url + "/metrics", timeout=30).text
        print(f"router-side TTFT of the admitted (tandem_ttft_seconds): p50 <= {_hist_quantile(metrics, 0.5)} s, "
              f"p99 <= {_hist_quantile(metrics, 0.99)} s (bucket bounds; warm-up included)")
        assert sum(_metric(metrics, "tandem_router_worker_cutoffs_total")) == 0
        assert sum(_metric(metrics, "tandem_admission_rejected_total")) == statuses[429]
        assert _metric(metrics, 'tandem_requests_total{endpoint="/v1/completions",status="429"}') == [statuses[429]] \
            or statuses[429] == 0
        loads = wait_idle(workers, 60)
        assert all(ld.used_blocks == 0 and ld.running == 0 and ld.waiting == 0 for ld in loads), loads
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
