"""A NIXL WRITE never lands in KV blocks decode already gave to another request.

NIXL WRITEs are one-sided: the decode side's threads never move a byte, so releasing a reservation cannot wait for
a write in progress. A reservation released before DONE while a sender it accepted (READY) may still write stays
held until that sender's QUIET (or its lease deadline plus the grace, for a dead sender); the decode connector keeps
the engine's blocks held meanwhile. Real NIXL agents on loopback (``UCX_NET_DEVICES=lo``), real engines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")

from bench.kv_peer import digest, make_caches
from decode_worker.connector import DecodeConnector
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer import KVLayout, TransferState
from kvtransfer.base import KVReceiver, KVSender
from kvtransfer.nixl_backend import QUARANTINE_GRACE_S, NixlReceiver, NixlSender
from kvtransfer.tcp import TcpReceiver, TcpSender
from worker.server import kv_layout_for

LAYOUT = KVLayout("tiny-llama", "float16", num_layers=4, block_size=4, num_kv_heads=4, head_dim=8)
DST, SRC = [1, 2], [5, 6]
SENTINEL = -7.0


def _until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def _fill(caches: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int], layers: range | None = None) -> None:
    for layer, (k, v) in enumerate(caches):
        if layers is None or layer in layers:
            k[blocks] = SENTINEL
            v[blocks] = SENTINEL


@pytest.fixture
def agents() -> Iterator[tuple[NixlReceiver, NixlSender, list, list]]:
    r, s = NixlReceiver(), NixlSender()
    dst, src = make_caches(LAYOUT, 8, None), make_caches(LAYOUT, 8, 9)
    r.register(dst, LAYOUT)
    s.register(src, LAYOUT)
    try:
        yield r, s, dst, src
    finally:
        s.close()
        r.close()


def test_a_reservation_released_mid_transfer_is_held_until_quiet_and_nothing_lands_after(agents: tuple) -> None:
    """Layer 0 landed; the sender's progress thread is about to post layer 1 (the test holds its post lock, so the
    post comes after the release, deterministically: the WRITE that would corrupt a reused block). The release says
    "hold"; layer 1 does land after it; QUIET comes only once that WRITE is over; after quiet, a sentinel in the
    blocks stays intact while the test hands the sender its remaining layers."""
    r, s, dst, src = agents
    d = r.reserve("cut", DST, 8, time.time() + 30)
    s.start("cut", d, SRC, time.time() + 30)
    s.send_layer("cut", 0)
    _until(lambda: r.poll("cut").layers_done >= 1, 10, "layer 0 to land (READY, then its WRITE)")
    _fill(dst, DST, range(1, 2))
    leg = s.book.get("cut").ctx.legs[0]
    with s._post_lock:  # the progress thread takes layer 1 from its queue and waits here to post it
        s.send_layer("cut", 1)
        _until(lambda: not leg.peer.waiting, 10, "the progress thread to take layer 1")
        assert r.release("cut") is True  # the sender was sent READY and has not said QUIET
        time.sleep(0.2)
        assert r.quiet() == [] and r.held() == 1  # no QUIET can come while its post is pending
    _until(lambda: r.held() == 0, 10, "the sender's QUIET")
    assert r.quiet() == ["cut"] and r.quiet() == []  # listed once
    assert s.poll("cut").state == TransferState.FAILED
    assert digest(dst, DST)[1] == digest(src, SRC)[1]  # the late WRITE landed: the hold was needed
    _fill(dst, DST)
    before = digest(dst, DST)
    for layer in (2, 3):
        s.send_layer("cut", layer)
    s.finish("cut")
    time.sleep(0.3)
    assert digest(dst, DST) == before  # nothing written after quiet
    s.release("cut")
    time.sleep(0.1)
    assert digest(dst, DST) == before


def test_released_before_any_hello_is_accepted_frees_at_once_and_nothing_is_written(agents: tuple) -> None:
    """No HELLO was accepted, so no sender may write: release says "free now", the late HELLO is answered FAIL
    (never READY), and the sender, which was handed every layer, writes nothing."""
    r, s, dst, _ = agents
    d = r.reserve("early", DST, 8, time.time() + 30)
    assert r.release("early") is False and r.held() == 0
    _fill(dst, DST)
    before = digest(dst, DST)
    s.start("early", d, SRC, time.time() + 30)
    for layer in range(LAYOUT.num_layers):
        s.send_layer("early", layer)
    s.finish("early")
    _until(lambda: s.poll("early").finished, 10, "the sender to fail")
    assert s.poll("early").state == TransferState.FAILED
    time.sleep(0.2)
    assert digest(dst, DST) == before and r.quiet() == []


def test_a_sender_past_its_deadline_writes_nothing_more(agents: tuple) -> None:
    """Past its lease deadline the sender posts nothing (its lease reaper fails it, and each post checks the
    deadline first): layers handed over after it are never written, and the receiver's hold ends with its QUIET."""
    r, s, dst, _ = agents
    d = r.reserve("late", DST, 8, time.time() + 30)
    s.start("late", d, SRC, time.time() + 3.0)  # room for the first HELLO (agents added) under load
    s.send_layer("late", 0)
    _until(lambda: r.poll("late").layers_done >= 1, 10, "layer 0 to land")
    _fill(dst, DST, range(1, 4))
    before = digest(dst, DST)
    time.sleep(max(0.0, s.book.get("late").deadline - time.monotonic()) + 0.05)
    for layer in range(1, LAYOUT.num_layers):
        s.send_layer("late", layer)
    _until(lambda: s.poll("late").finished, 10, "the sender's lease to end")
    assert s.poll("late").state == TransferState.FAILED
    time.sleep(0.2)
    assert digest(dst, DST) == before
    assert r.release("late") in (True, False)
    _until(lambda: r.held() == 0, 10, "the receiver's hold to end")


_CHILD = """
import sys, time
from bench.kv_peer import make_caches
from kvtransfer import DestinationInfo, KVLayout
from kvtransfer.nixl_backend import NixlSender
layout = KVLayout("tiny-llama", "float16", num_layers=4, block_size=4, num_kv_heads=4, head_dim=8)
s = NixlSender()
s.register(make_caches(layout, 8, 9), layout)
d = DestinationInfo.from_bytes(bytes.fromhex(sys.stdin.readline().strip()))
s.start("dead", d, [5, 6], d.deadline_s)
s.send_layer("dead", 0)
print("started", flush=True)
time.sleep(600)
"""


def test_a_killed_senders_hold_ends_at_the_lease_deadline_plus_grace(agents: tuple) -> None:
    """kill -9 of the process holding the sender after its first layer landed: no QUIET ever comes, so the
    receiver holds the blocks until its lease deadline plus ``QUARANTINE_GRACE_S``, then lists them quiet."""
    r, _, _, _ = agents
    lease_s = 8.0
    d = r.reserve("dead", DST, 8, time.time() + lease_s)
    deadline = r.book.get("dead").deadline
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(d.to_bytes().hex() + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "started"
        _until(lambda: r.poll("dead").layers_done >= 1, 10, "layer 0 to land")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert time.monotonic() < deadline - 0.5, "too slow a start to check the hold before the deadline"
        assert r.release("dead") is True
        time.sleep(max(0.0, deadline - time.monotonic()))
        assert r.quiet() == [] and r.held() == 1  # held through the lease
        _until(lambda: r.held() == 0, QUARANTINE_GRACE_S + 2, "the hold to end")
        assert time.monotonic() >= deadline + QUARANTINE_GRACE_S
        assert r.quiet() == ["dead"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


# ---- the decode connector on a real engine ---------------------------------------------------------------------

BLOCKS = 16
PROMPT = list(range(3, 13))  # 10 tokens: blocks 0, 1, 2 of a fresh pool
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _decode_engine(path: Path, receiver: KVReceiver) -> tuple[LLMEngine, DecodeConnector]:
    eng = LLMEngine(EngineConfig(model=str(path), num_threads=1, cache=CacheConfig(block_size=4, num_blocks=BLOCKS)))
    dc = DecodeConnector(receiver, kv_layout_for(eng), wake=lambda: None)
    eng.attach_connector(dc)
    return eng, dc


def _abort_mid_transfer(path: Path, receiver: KVReceiver, sender: KVSender) -> tuple[LLMEngine, KVSender]:
    """A decode engine reserves blocks 0, 1, 2 for a prompt; the sender lands its layer 0, then decode aborts."""
    eng, dc = _decode_engine(path, receiver)
    layout = kv_layout_for(eng)
    sender.register(make_caches(layout, BLOCKS, 4), layout)
    dc.expect("a", time.time() + 30)
    assert eng.add(eng.make_request(PROMPT, GREEDY, "a"))
    dc.forget("a")
    where = dc.destination("a")
    assert where is not None and where[0].dst_block_ids == (0, 1, 2)
    sender.start("a", where[0], [3, 4, 5], time.time() + 30)
    sender.send_layer("a", 0)
    _until(lambda: receiver.poll("a").layers_done >= 1, 10, "layer 0 to land")
    return eng, sender


@pytest.fixture(scope="module")
def llama(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


def test_an_aborted_nixl_request_keeps_its_blocks_held_until_quiet_then_frees_them(llama: Path) -> None:
    r, s = NixlReceiver(), NixlSender()
    try:
        eng, _ = _abort_mid_transfer(llama, r, s)
        with s._post_lock:  # the sender cannot say QUIET yet
            (out,) = eng.abort(["a"])
            assert out.finish_reason == "abort"
            for _ in range(5):
                eng.step()
            assert list(eng.kv.held) == ["a"] and eng.pool.num_free_blocks == BLOCKS - 3
            assert eng.has_unfinished()  # the held blocks keep the loop stepping
        _until(lambda: (eng.step(), not eng.has_unfinished())[1], 10, "the held blocks to be freed")
        assert eng.pool.num_free_blocks == BLOCKS and not eng.kv.held
        eng.check_block_accounting()
    finally:
        s.close()
        r.close()


def test_an_aborted_tcp_request_frees_its_blocks_at_once(llama: Path) -> None:
    r, s = TcpReceiver(), TcpSender()
    try:
        eng, _ = _abort_mid_transfer(llama, r, s)
        (out,) = eng.abort(["a"])
        assert out.finish_reason == "abort"
        assert not eng.kv.held and eng.pool.num_free_blocks == BLOCKS and not eng.has_unfinished()
        eng.check_block_accounting()
    finally:
        s.close()
        r.close()
