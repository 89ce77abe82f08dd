"""The prefill and decode roles as KV connectors (prefill_worker/connector.py, decode_worker/connector.py) on two
real engines in this process, over kvtransfer's in-process fake backend (the real backends need a second process
and are covered end to end by test_disaggregated.py).

Each test drives both engines' steps by hand, so block ids are exact on both sides: the decode engine reserves
blocks 0, 1, 2 for a 10-token prompt in 4-token blocks, the prefill engine holds its 0, 1, 2 after the request
finished until the send ends, DONE or FAILED, and both pools end full.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from decode_worker.connector import DecodeConnector
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.fake import FakeBehaviour, FakeReceiver, FakeSender
from prefill_worker.connector import PrefillConnector
from worker.server import kv_layout_for

BLOCKS = 16
PROMPT = list(range(3, 13))  # 10 tokens: 3 blocks of 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_threads=1, cache=CacheConfig(block_size=4, num_blocks=BLOCKS)))


def _steps_until(eng: LLMEngine, done: Callable[[], bool], timeout_s: float = 20.0) -> list[RequestOutput]:
    """Step ``eng`` until ``done()`` (the transport's threads land bytes meanwhile); bounded in time."""
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out stepping the engine"
        outs += eng.step()
        time.sleep(0.002)
    return outs


class Pair:
    def __init__(self, path: Path, behaviour: FakeBehaviour | None = None) -> None:
        self.pre, self.dec = _engine(path), _engine(path)
        layout = kv_layout_for(self.pre)
        self.sender, self.receiver = FakeSender(behaviour=behaviour), FakeReceiver()
        self.pc = PrefillConnector(self.sender, layout, wake=lambda: None)
        self.dc = DecodeConnector(self.receiver, layout, wake=lambda: None)
        self.pre.attach_connector(self.pc)
        self.dec.attach_connector(self.dc)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def llama(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


def _reserve_and_prefill(p: Pair, rid: str) -> int:
    """Reserve on decode (Prealloc → Transfer), prefill with the destination; the first token."""
    p.dc.expect(rid, time.time() + 20)
    assert p.dec.add(p.dec.make_request(PROMPT, GREEDY, rid))
    p.dc.forget(rid)
    where = p.dc.destination(rid)
    assert where is not None
    dest, num_blocks = where
    assert num_blocks == 3 and dest.dst_block_ids == (0, 1, 2) and p.dec.pool.num_free_blocks == BLOCKS - 3
    p.pre.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), rid)
    p.pc.expect(rid, dest, dest.deadline_s)
    (first,) = p.pre.step()
    assert first.finished and len(first.token_ids) == 1  # the first token is back before the send ends
    assert p.pre.kv.held.keys() == {rid} and [b.block_id for b in p.pre.kv.held[rid]] == [0, 1, 2]
    return first.token_ids[0]


def test_a_prefill_decode_pair_over_the_fake_transport_equals_colocated_and_frees_every_block(llama: Path) -> None:
    want = [t for o in _colocated(llama) for t in o.new_token_ids]
    p = Pair(llama)
    try:
        first = _reserve_and_prefill(p, "r")
        _steps_until(p.pre, lambda: not p.pre.has_unfinished())  # DONE: the hold is dropped
        assert p.pc.load()["kv_transfers_done"] == 1 and p.pre.pool.num_free_blocks == BLOCKS
        p.pre.check_block_accounting()
        assert p.dc.deliver("r", first, None) is None
        assert p.dc.deliver("r", first, None) is not None  # a second Decode for one reservation is refused
        outs = _steps_until(p.dec, lambda: not p.dec.has_unfinished())
        assert [t for o in outs for t in o.new_token_ids] == want
        assert p.dec.pool.num_free_blocks == BLOCKS
        p.dec.check_block_accounting()
    finally:
        p.close()


def test_a_send_failing_mid_transfer_frees_both_sides_and_fails_the_decode_request(llama: Path) -> None:
    p = Pair(llama, FakeBehaviour(fail_at_layer=1, message="fake: peer died"))
    try:
        _reserve_and_prefill(p, "r")
        _steps_until(p.pre, lambda: not p.pre.has_unfinished())  # FAILED: the hold is dropped all the same
        assert p.pc.load()["kv_transfers_failed"] == 1 and p.pre.pool.num_free_blocks == BLOCKS
        p.pre.check_block_accounting()
        outs = _steps_until(p.dec, lambda: not p.dec.has_unfinished())
        assert [o.finish_reason for o in outs] == ["error"] and "KV transfer failed" in outs[0].new_text
        assert "r" in p.dc.failed and p.dc.deliver("r", 1, None) == p.dc.failed["r"]
        assert p.dec.pool.num_free_blocks == BLOCKS
        p.dec.check_block_accounting()
    finally:
        p.close()


def test_an_aborted_inflight_send_frees_the_prefill_hold_at_the_next_step(llama: Path) -> None:
    p = Pair(llama, FakeBehaviour(stall_from_layer=0))  # nothing lands: only the abort (or the lease) ends it
    try:
        _reserve_and_prefill(p, "r")
        assert p.pre.step() == [] and p.pre.pool.num_free_blocks == BLOCKS - 3
        assert p.pc.cancel("r")
        p.pre.step()
        assert p.pre.pool.num_free_blocks == BLOCKS and not p.pre.has_unfinished()
        p.pre.check_block_accounting()
        (out,) = p.dec.abort(["r"])
        assert out.finish_reason == "abort" and p.dc.in_transfer() == 0
        assert p.dec.pool.num_free_blocks == BLOCKS
        p.dec.check_block_accounting()
    finally:
        p.close()


def _colocated(path: Path) -> list[RequestOutput]:
    eng = _engine(path)
    eng.add_request(PROMPT, GREEDY, "c")
    return _steps_until(eng, lambda: not eng.has_unfinished())
