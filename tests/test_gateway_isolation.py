"""One request never fails another (issue 24 §1): malformed requests sent in the same instant as valid ones get
their own 400 and nothing else changes; a request whose handling raises gets a 500 with a request id (logged) and
its work is aborted on the worker; other requests in flight finish token-exact. Two real ``tandem worker``
processes (colocated) behind an in-process router; greedy references from transformers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread, wait_idle

from engine.tokenizer import Tokenizer
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(6 + i)] for i in range(6)]
MAX_TOKENS = 6
POISON: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "stop_token_ids": [True]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                              "max_tokens": 4}),
]


@pytest.fixture(scope="module")
def workers(checkpoint: Callable[[str], Path]) -> Iterator[list[WorkerProcess]]:
    ws = [start_worker("decode", str(checkpoint("llama")), "tcp", [*WORKER_FLAGS, "--worker-id", f"iso-{i}"])
          for i in range(2)]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def router(workers: list[WorkerProcess], checkpoint: Callable[[str], Path]) -> Iterator[RouterThread]:
    rt = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=tuple(w.address for w in workers)))
    yield rt
    rt.stop()


def _reference(hf_greedy: Callable[..., list[int]], checkpoint: Callable[[str], Path]) -> list[str]:
    """transformers' greedy continuation of each prompt, as the text the gateway must answer."""
    tokenizer = Tokenizer(checkpoint("llama"))
    return [tokenizer.decode(hf_greedy(checkpoint("llama"), p, MAX_TOKENS)) for p in PROMPTS]


def test_a_malformed_request_among_30_valid_ones_fails_only_itself_10_rounds(
        router: RouterThread, workers: list[WorkerProcess], checkpoint: Callable[[str], Path],
        hf_greedy: Callable[..., list[int]]) -> None:
    """The issue's poison test: each round sends 30 valid requests (half streamed) and one of the two poison
    payloads at once; every valid one answers 200 with transformers' greedy tokens, the poison one 400."""
    model = checkpoint("llama").name
    ref = _reference(hf_greedy, checkpoint)

    async def round_(n: int) -> tuple[list[Any], httpx.Response]:
        path, poison = POISON[n % 2]
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=router.url, timeout=120, limits=limits) as client:
            valid = [_exact(client, model, i, ref) for i in range(30)]
            bad = client.post(path, json={"model": model, **poison})
            *answers, bad_answer = await asyncio.gather(*valid, bad)
        assert isinstance(bad_answer, httpx.Response)
        return answers, bad_answer

    async def main() -> None:
        for n in range(10):
            answers, bad = await round_(n)
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["type"] == "invalid_request_error"
            failed = [a for a in answers if a is not True]
            assert not failed, f"round {n}: {failed[:3]}"

    asyncio.run(asyncio.wait_for(main(), 600))
    loads = wait_idle(workers)
    assert all(ld.used_blocks == 0 and ld.running == 0 for ld in loads), loads


async def _exact(client: httpx.AsyncClient, model: str, i: int, ref: list[str]) -> bool | str:
    """True if request ``i`` (odd: streamed) answers 200 with the text of transformers' greedy tokens."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if i % 2:
        text = ""
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"{r.status_code}: {(await r.aread()).decode()[:200]}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        return f"stream error: {chunk['error']}"
                    text += "".join(c["text"] for c in chunk["choices"])
    else:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return f"{r.status_code}: {r.text[:200]}"
        text = r.json()["choices"][0]["text"]
    return True if text == ref[i % len(PROMPTS)] else f"request {i}: got {text!r}, want {ref[i % len(PROMPTS)]!r}"


def test_an_unexpected_exception_answers_500_with_a_request_id_and_aborts_its_work(
        router: RouterThread, workers: list[WorkerProcess], checkpoint: Callable[[str], Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """A bug that raises while one request is being answered (injected here: the gateway's chunk absorption fails
    for requests with ``max_tokens`` 777) answers that request 500 with a request id that the log also carries;
    its generation is aborted on the worker (no block left held), and requests beside it answer 200."""
    model = checkpoint("llama").name
    original = router.call(lambda r: r.gateway._absorb)

    def absorb(req: Any, c: Any, chunk: Any) -> str:
        if req.params.max_tokens == 777:
            raise RuntimeError("injected gateway bug")
        return original(req, c, chunk)  # type: ignore[no-any-return]

    router.call(lambda r: setattr(r.gateway, "_absorb", absorb))
    caplog.set_level(logging.ERROR, logger="router.asgi")
    try:
        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
                body = {"model": model, "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True}
                return list(await asyncio.gather(client.post("/v1/completions", json={**body, "max_tokens": 777}),
                                                 *(client.post("/v1/completions", json={**body, "max_tokens": 5})
                                                   for _ in range(8))))

        bad, *good = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        router.call(lambda r: delattr(r.gateway, "_absorb"))
    assert bad.status_code == 500, bad.text
    rid = bad.json()["error"]["request_id"]
    assert bad.headers["x-request-id"] == rid and "injected" not in bad.text
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert all(r.status_code == 200 for r in good)
    loads = wait_idle(workers)
    assert all(ld.used_blocks == 0 and ld.running == 0 for ld in loads), loads
