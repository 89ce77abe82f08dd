"""Parking (worker/parking.py) on a real engine in this process: a request whose client is not reading stops
generating, keeps its blocks, and resumes token-exact; one parked past the stall timeout fails with a clear error
and frees its blocks. The end-to-end paths (a slow SSE reader through the router) are in test_backpressure.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from worker.parking import Parking

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_threads=1, cache=CacheConfig(num_blocks=64)))


def test_a_parked_request_keeps_its_blocks_generates_nothing_and_resumes_exactly(
        checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    eng = _engine(path)
    parking = Parking(60.0, lambda e, rid, msg: None)
    prompts = {"slow": [5, 6, 7, 8], "other": [9, 10, 11]}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        eng.add_request(prompt, GREEDY, rid)

    def step() -> None:
        for out in eng.step():
            tokens[out.request_id].extend(out.new_token_ids)
        parking.poll(eng)

    for _ in range(4):
        step()
    parking.want("slow")
    parking.poll(eng)
    assert len(parking) == 1
    held, n = list(eng.kv.block_ids("slow")), len(tokens["slow"])
    for _ in range(6):
        step()
    assert len(tokens["slow"]) == n and eng.kv.block_ids("slow") == held  # nothing generated, nothing freed
    assert len(tokens["other"]) > n  # the rest of the batch went on
    parking.resume(eng, "slow")
    while eng.has_unfinished():
        step()
    ref = LLM(str(path), num_kv_blocks=64).generate(list(prompts.values()), GREEDY)
    assert [tokens[rid] for rid in prompts] == [r.token_ids for r in ref]
    assert eng.pool.num_used_blocks == 0


def test_a_request_parked_past_the_stall_timeout_fails_with_a_clear_error_and_frees_its_blocks(
        checkpoint: Callable[[str], Path]) -> None:
    eng = _engine(checkpoint("llama"))
    failed: list[tuple[str, str]] = []

    def fail(e: LLMEngine, rid: str, message: str) -> None:
        failed.append((rid, message))
        e.finish_request(rid, RequestStatus.FINISHED_ERROR)

    parking = Parking(0.2, fail)
    eng.add_request([5, 6, 7], GREEDY, "stuck")
    eng.step()
    parking.want("stuck")
    parking.poll(eng)
    assert len(parking) == 1 and not eng.has_unfinished()  # parked: no work for the engine loop, blocks held
    assert eng.pool.num_used_blocks > 0
    time.sleep(0.3)
    parking.poll(eng)
    assert failed and failed[0][0] == "stuck" and "stalled" in failed[0][1] and "0.2 s" in failed[0][1]
    assert parking.is_stall("stuck") and len(parking) == 0
    assert eng.pool.num_used_blocks == 0
