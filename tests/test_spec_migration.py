"""Speculative decoding across a migration: the decode worker serving a greedy request with ``--speculative ngram``
is SIGKILLed mid-output, the router resends prompt + tokens so far to the other decode worker (itself speculating),
and the request's tokens are exactly transformers' greedy continuation, which is also what the offline engine
gives without speculation. Colocated (two decode workers, no prefill worker) and disaggregated (a prefill worker
over tcp: the migrated request is prefilled again, and only the prefill's KV travels, never a proposal's).

Real ``tandem worker`` processes on loopback, the router in-process (its dispatcher is driven directly, so that the
test sees token ids, not text). The surviving worker's own /metrics shows it verified proposals for the migrated
request, and both surviving workers end with every block free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from auth.token import ensure_cluster_token
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from proto.tandem.v1 import worker_pb2 as pb
from router.dispatch import Plan
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
SPEC = ["--speculative", "ngram", "--num-speculative-tokens", "3"]
MAX_TOKENS = 96
KILL_AFTER_CHUNKS = 2  # early and the output long: under load the router reads several steps' tokens as one chunk


def _spec_counters(w: WorkerProcess) -> dict[str, float]:
    body = httpx.get(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.name.startswith("tandem_spec_decode_") and s.name.endswith("_total")}


def _run_and_kill(rt: RouterThread, prompt: list[int], decodes: list[WorkerProcess]) -> tuple[list[int], str]:
    """Run one greedy request through the router's dispatcher, SIGKILL its decode worker after a few chunks;
    the request's tokens and the id of the worker that was killed."""
    plans: list[Plan] = []
    victim: list[str] = []

    async def run() -> list[int]:
        assert rt.router is not None
        params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        chunks = 0
        async for chunk in rt.router.dispatcher.run("spec-mig", prompt, params, plan_out=plans):
            tokens.extend(chunk.token_ids)
            chunks += 1
            if chunks == KILL_AFTER_CHUNKS:
                victim.append(plans[-1].decode.worker_id)
                by_id = {f"specmig-{i}": w for i, w in enumerate(decodes)}
                await asyncio.to_thread(by_id[victim[0]].kill)
        return tokens

    tokens = asyncio.run_coroutine_threadsafe(run(), rt.loop).result(300)
    assert victim, "the request finished before the kill"
    assert len(tokens) < MAX_TOKENS or len(plans) == 2
    return tokens, victim[0]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_speculating_decode_worker_killed_mid_output_migrates_token_exactly(
        mode: str, checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    model = checkpoint("llama")
    ensure_cluster_token()  # once, before the workers start side by side (each inherits it)
    pool = ThreadPoolExecutor(3)
    # the workers start while the references are computed (were one after another)
    starting = [pool.submit(start_worker, "decode", str(model), "tcp", [*WORKER_FLAGS, *SPEC, "--worker-id",
                                                                        f"specmig-{i}", "--metrics-port", "0"])
                for i in range(2)]
    if mode == "disaggregated":
        starting.append(pool.submit(start_worker, "prefill", str(model), "tcp",
                                    [*WORKER_FLAGS, "--worker-id", "specmig-pre"]))
    pool.shutdown(wait=False)
    rt: RouterThread | None = None
    try:
        offline = LLM(str(model), num_threads=1, num_kv_blocks=256)
        prompt = offline.tokenizer.encode("hello " * 40)  # 81 tokens: past the router's 64 uncached for prefill
        want = hf_greedy(model, prompt, MAX_TOKENS)
        plain = offline.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        assert plain[0].token_ids == want
        workers = [f.result() for f in starting]  # a failed start raises; the finally stops those that started
        decodes, pre = workers[:2], (workers[2] if mode == "disaggregated" else None)
        rt = RouterThread(RouterConfig(model=str(model), workers=tuple(w.address for w in workers)))
        plans_before = rt.call(lambda r: dict(r.dispatcher.stats.decisions))
        tokens, victim = _run_and_kill(rt, prompt, decodes)
        assert tokens == want
        assert rt.call(lambda r: r.dispatcher.stats.migrations) == 1
        decisions = rt.call(lambda r: dict(r.dispatcher.stats.decisions))
        routed = {k: decisions.get(k, 0) - plans_before.get(k, 0) for k in decisions}
        assert routed.get("long_uncached_prompt", 0) == (2 if pre else 0), routed
        survivor = next(w for i, w in enumerate(decodes) if f"specmig-{i}" != victim)
        counters = _spec_counters(survivor)
        assert counters["tandem_spec_decode_drafts_total"] > 0, counters  # it speculated on the migrated request
        alive = [survivor, *([pre] if pre else [])]
        idle = wait_idle(alive)
        assert [ld.used_blocks for ld in idle] == [0] * len(alive)
        assert [ld.held_blocks for ld in idle] == [0] * len(alive)
    finally:
        if rt is not None:
            rt.stop()
        for f in starting:  # every worker that started, whether or not the test got as far as using it
            if not f.cancelled() and f.exception() is None:
                f.result().stop()
