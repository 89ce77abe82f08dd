"""NIXL-specific kvtransfer checks: descriptors for block runs and head slices, the hand-off, TP over real agents.

The two-process NIXL transfers (exact bytes, layer-by-layer, mismatch, kill -9 of either side) run with the other
backends in ``test_kvtransfer.py``; this file covers what only the NIXL backend does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

from bench.kv_peer import digest, make_caches
from kvtransfer import DestinationInfo, KVLayout, TransferState
from kvtransfer.book import Entry
from kvtransfer.nixl_backend import NixlReceiver, NixlSender, piece_offsets
from kvtransfer.plan import plan_leg

LAYOUT = KVLayout("tiny-llama", "float16", num_layers=2, block_size=4, num_kv_heads=4, head_dim=8)


_IDLE_PROBE = """
import resource, sys, time
import torch
from kvtransfer.config import TransferConfig
from kvtransfer.nixl_agent import make_agent
agent = make_agent(TransferConfig(nixl_progress_delay_us=int(sys.argv[1])), "idle")
reg = agent.register_memory(torch.zeros(1 << 16))
time.sleep(0.2)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep(1.0)
r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
print((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (t1 - t0))
"""


def _idle_cpu_of_agent(delay_us: int) -> float:
    """CPU cores a fresh process burns over 1 s while its only NIXL agent (progress thread on) sits idle.

    A process of its own, so that no other test's threads are counted."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _IDLE_PROBE, str(delay_us)], capture_output=True, text=True,
                         timeout=120, check=True, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    return float(out.stdout.strip())  # nothing else on stdout: NIXL's own log lines go to stderr


def test_idle_agent_progress_thread_does_not_spin_a_core() -> None:
    """NIXL's Python API starts its progress thread with no delay (a full core, forever); ours sleeps between
    idle passes. A spinning thread would take ~1 core, so 0.5 separates the two with a wide margin."""
    assert _idle_cpu_of_agent(100) < 0.5


def _count_polls(r: NixlReceiver) -> list[int]:
    """Count the receiver's notification polls: ``calls[0]`` goes up by one per ``get_new_notifs``."""
    calls = [0]
    real = r._agent.get_new_notifs

    def counted() -> dict:
        calls[0] += 1
        return real()

    r._agent.get_new_notifs = counted  # type: ignore[method-assign]  # count the receiver's polls
    return calls


def test_receiver_polls_notifications_only_while_a_reservation_is_open() -> None:
    """The decode side's notification thread takes the decode loop's CPU and GIL each time it wakes: with nothing
    reserved it does not poll, with a reservation open it polls at the configured tick (2 ms), and it goes quiet
    again once the reservation is gone. How it paces a transfer's layers: the next test."""
    r = NixlReceiver()
    calls = _count_polls(r)
    try:
        r.register(make_caches(LAYOUT, 8, None), LAYOUT)
        time.sleep(0.3)
        idle = calls[0]
        r.reserve("open", [1, 2], 8, time.time() + 20)
        time.sleep(0.3)
        open_polls = calls[0] - idle
        r.release("open")
        time.sleep(0.1)  # the next poll sees the reservation gone
        before = calls[0]
        time.sleep(0.3)
        assert idle <= 2 and calls[0] - before <= 2, (idle, calls[0] - before)
        assert 20 <= open_polls <= 200, open_polls
    finally:
        r.close()


def test_sender_fails_at_once_when_decode_released_before_seeing_its_hello() -> None:
    """Decode aborts a request (its reservation released) before its watcher saw the sender's HELLO, so the
    receiver knew no sender to tell: the late HELLO is answered with FAIL and the sender, whose layers were all
    handed over, ends FAILED within seconds instead of holding prefill's blocks until its 60 s lease expires."""
    r, s = NixlReceiver(), NixlSender()
    try:
        r.register(make_caches(LAYOUT, 8, None), LAYOUT)
        s.register(make_caches(LAYOUT, 8, 1), LAYOUT)
        d = r.reserve("gone", [1, 2], 8, time.time() + 60)
        r.release("gone")
        s.start("gone", d, [3, 4], time.time() + 60)
        for layer in range(LAYOUT.num_layers):
            s.send_layer("gone", layer)
        s.finish("gone")
        end = time.monotonic() + 15
        while not s.poll("gone").finished and time.monotonic() < end:
            time.sleep(0.01)
        st = s.poll("gone")
        assert st.state == TransferState.FAILED and "no live reservation" in (st.error or ""), st
    finally:
        s.close()
        r.close()


def test_a_progress_tick_while_start_still_plans_the_leg_does_not_prepare_it_from_an_empty_plan() -> None:
    """The progress thread prepares a leg's WRITEs while its READY is on the way, but only once the leg's HELLO is
    out: before that, ``start`` may still be planning the leg's pieces on the caller's thread. Here the plan is
    slowed down and the progress thread woken in the middle of it (what a tick of its own poll did once in CI,
    which failed the transfer with "index 0 is out of bounds"); the transfer still lands every byte."""
    r, s = NixlReceiver(), NixlSender()
    plan = s.out.plan

    def slow_plan(entry: Entry) -> KVLayout:
        s._wake.set()  # a progress tick now, with the leg's peer set and its pieces not yet planned
        time.sleep(0.3)
        return plan(entry)

    s.out.plan = slow_plan  # type: ignore[method-assign]
    try:
        src, dst = make_caches(LAYOUT, 8, 1), make_caches(LAYOUT, 8, None)
        r.register(dst, LAYOUT)
        s.register(src, LAYOUT)
        d = r.reserve("planned", [5, 6], 8, time.time() + 60)
        s.start("planned", d, [1, 2], time.time() + 60)
        for layer in range(LAYOUT.num_layers):
            s.send_layer("planned", layer)
        s.finish("planned")
        end = time.monotonic() + 15
        while not (s.poll("planned").finished and r.poll("planned").finished) and time.monotonic() < end:
            time.sleep(0.01)
        assert s.poll("planned").state == r.poll("planned").state == TransferState.DONE, (
            s.poll("planned"), r.poll("planned"))
        assert digest(src, [1, 2]) == digest(dst, [5, 6])
    finally:
        s.close()
        r.close()


def test_receiver_paces_its_polls_by_a_long_prefills_layers_and_still_catches_the_last_one_at_once() -> None:
    """A 16-layer prefill whose layers come 15 ms apart (as a long prompt's do) is polled a few dozen times, not
    every 2 ms tick plus every 250 us while its last layer is due (~160 polls before), because the watcher predicts
    the last layer from the layers' hand-over times the DATA notifications carry; yet the receiver sees that layer
    land within a few milliseconds of its post (median of 4 transfers; typically ~0.3 ms here, as before)."""
    import statistics

    layout = KVLayout("paced", "float16", num_layers=16, block_size=4, num_kv_heads=2, head_dim=8)
    r, s = NixlReceiver(), NixlSender()
    calls = _count_polls(r)
    done_at: dict[str, float] = {}

    def on_done(rid: str) -> None:
        done_at.setdefault(rid, time.perf_counter())

    r.set_on_done(on_done)
    latencies, polls = [], []
    try:
        r.register(make_caches(layout, 16, None), layout)
        s.register(make_caches(layout, 16, 1), layout)
        for i in range(5):  # the first one adds the remote agent on both sides: not counted
            rid = f"paced-{i}"
            before = calls[0]
            d = r.reserve(rid, [0, 1, 2], 12, time.time() + 20)
            s.start(rid, d, [5, 6, 7], time.time() + 20)
            for layer in range(layout.num_layers):
                if layer:
                    time.sleep(0.015)
                s.send_layer(rid, layer)
            posted = time.perf_counter()
            s.finish(rid)
            end = time.monotonic() + 10
            while not (rid in done_at and s.poll(rid).finished) and time.monotonic() < end:
                time.sleep(0.001)
            assert r.poll(rid).state == TransferState.DONE
            if i:
                latencies.append(done_at[rid] - posted)
                polls.append(calls[0] - before)
            s.release(rid)
            r.release(rid)
    finally:
        s.close()
        r.close()
    assert statistics.median(polls) <= 90, polls
    assert statistics.median(latencies) < 0.005, latencies


def test_last_dram_layer_is_posted_by_the_caller_and_earlier_layers_by_the_progress_thread() -> None:
    """The last layer is on the request's critical path: it is posted (and its completion checked, which is what
    releases NIXL's DATA notification) on the thread that calls ``send_layer``, with no wake-up of the progress
    thread in between. Earlier layers are posted by the progress thread while the caller computes. The bytes and
    both sides' states are the same either way."""
    import threading

    src, dst = make_caches(LAYOUT, 8, 5), make_caches(LAYOUT, 8, None)
    r, s = NixlReceiver(), NixlSender()
    posted: list[tuple[int, str]] = []
    post = s._post

    def recording(entry: object, leg: object, layer: int, handed: float) -> None:
        posted.append((layer, threading.current_thread().name))
        post(entry, leg, layer, handed)  # type: ignore[arg-type]

    s._post = recording  # type: ignore[method-assign]
    try:
        r.register(dst, LAYOUT)
        s.register(src, LAYOUT)
        d = r.reserve("inline", [4, 5], 8, time.time() + 20)
        s.start("inline", d, [1, 2], time.time() + 20)
        s.send_layer("inline", 0)
        end = time.monotonic() + 5
        # the first layer prepares the leg on the progress thread; once it is sent the leg is certainly prepared
        while s.poll("inline").layers_done < 1 and time.monotonic() < end:
            time.sleep(0.001)
        s.send_layer("inline", 1)
        s.finish("inline")
        end = time.monotonic() + 20
        while time.monotonic() < end and not (s.poll("inline").finished and r.poll("inline").finished):
            time.sleep(0.002)
        assert s.poll("inline").state == r.poll("inline").state == TransferState.DONE
        assert posted == [(0, "kv-nixl-progress"), (1, threading.current_thread().name)], posted
        assert digest(src, [1, 2]) == digest(dst, [4, 5])
    finally:
        s.close()
        r.close()


def test_nixl_log_lines_stay_off_stdout() -> None:
    """NIXL prints an INFO line per agent on stdout by default; a Tandem process's stdout carries its READY line and
    ``--json`` reports, so agents made through kvtransfer leave it empty (warnings still reach stderr)."""
    import subprocess
    import sys

    probe = ("from kvtransfer.config import TransferConfig\nfrom kvtransfer.nixl_agent import make_agent\n"
             "make_agent(TransferConfig(), 'quiet')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "UCX_NET_DEVICES": "lo"})
    assert out.stdout == ""


def test_full_head_runs_are_one_descriptor_each() -> None:
    """Equal TP: every paired block run becomes one descriptor per layer and K/V, at block-granular offsets."""
    pieces = plan_leg(LAYOUT, LAYOUT, [0, 1, 2, 9], [5, 6, 7, 3])
    src, dst, lens = piece_offsets(pieces, LAYOUT, LAYOUT)
    bb = LAYOUT.block_bytes
    assert src.tolist() == [0, 9 * bb] and dst.tolist() == [5 * bb, 3 * bb]
    assert lens.tolist() == [3 * bb, bb]


def test_head_slice_descriptors_address_exactly_the_sliced_elements() -> None:
    """TP 1→2: rank 1's descriptors cover exactly heads 2..3 of each source token row and land at heads 0..1."""
    dst = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=1)
    pieces = plan_leg(LAYOUT, dst, [3], [1])
    src_off, dst_off, lens = piece_offsets(pieces, LAYOUT, dst)
    t = torch.arange(8 * 4 * 4 * 8, dtype=torch.float16).view(8, 4, 4, 8)
    raw = t.view(torch.uint8).reshape(-1).numpy()
    got = np.concatenate([raw[o : o + n] for o, n in zip(src_off.tolist(), lens.tolist(), strict=True)])
    want = t[3:4, :, 2:4].contiguous().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(got, want)
    assert dst_off.tolist() == [(1 * 4 + row) * dst.token_bytes for row in range(4)]


def test_destination_info_carries_agent_metadata_and_regions_as_json() -> None:
    """reserve() publishes agent name, metadata bytes and per-layer K/V addresses in a JSON hand-off."""
    r = NixlReceiver()
    caches = make_caches(LAYOUT, 8, None)
    try:
        r.register(caches, LAYOUT)
        d = r.reserve("q", [1, 2], 8, time.time() + 5)
        doc = json.loads(d.to_bytes())
        assert doc["agent_name"].startswith("tandem-decode-")
        back = DestinationInfo.from_bytes(d.to_bytes())
        assert back.agent_metadata == d.agent_metadata and len(back.agent_metadata) > 0
        assert back.regions == tuple((k.data_ptr(), v.data_ptr()) for k, v in caches)
        assert os.environ["UCX_NET_DEVICES"] == "lo"
    finally:
        r.close()


@pytest.mark.timeout(60)
def test_tp2_prefill_into_tp1_decode_over_real_agents() -> None:
    """Two TP=2 prefill agents WRITE their head halves into one TP=1 decode agent; bytes equal the full KV."""
    full = make_caches(LAYOUT, 8, 11)
    r = NixlReceiver()
    dst = make_caches(LAYOUT, 8, None)
    senders = []
    try:
        r.register(dst, LAYOUT)
        d = r.reserve("tp", [6, 2, 3], 12, time.time() + 20)
        for rank in range(2):
            lay = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=rank)
            shard = [(k[:, :, 2 * rank : 2 * rank + 2].contiguous(), v[:, :, 2 * rank : 2 * rank + 2].contiguous())
                     for k, v in full]
            s = NixlSender()
            s.register(shard, lay)
            senders.append((s, shard))
            s.start("tp", d, [0, 1, 4], time.time() + 20)
        for layer in range(LAYOUT.num_layers):
            for s, _ in senders:
                s.send_layer("tp", layer)
        for s, _ in senders:
            s.finish("tp")
        end = time.monotonic() + 20
        while time.monotonic() < end and not all(s.poll("tp").finished for s, _ in senders):
            time.sleep(0.005)
        assert r.poll("tp").state == TransferState.DONE, r.poll("tp")
        assert all(s.poll("tp").state == TransferState.DONE for s, _ in senders)
        assert digest(full, [0, 1, 4]) == digest(dst, [6, 2, 3])
    finally:
        for s, _ in senders:
            s.close()
        r.close()


def test_data_notifications_carry_the_layer_hand_over_time_and_the_pace_predicts_the_last_layer_from_it() -> None:
    """A DATA notification is its frame header plus the microseconds after the HELLO at which the sender was given
    the layer; the receiver predicts the last layer from those offsets (the compute's pace), not from when the
    notifications arrived, and needs two layers for it."""
    from kvtransfer.nixl_agent import data_notif, handed_after
    from kvtransfer.nixl_backend import _Pace
    from kvtransfer.wire import Frame, Kind, unpack

    header = Frame(Kind.DATA, 7, layer=3, payload_len=4096).pack()
    msg = data_notif(header, 0.25)
    assert unpack(msg).layer == 3 and unpack(msg).payload_len == 4096 and handed_after(msg) == 0.25
    assert handed_after(header) is None and handed_after(data_notif(header, -1.0)) == 0.0
    pace = _Pace(hello_lo=100.0, hello_seen=100.002)
    pace.note(0, 0.001, now=100.003)
    assert pace.due(16) is None
    pace.note(2, 0.061, now=100.5)  # noticed late: arrival times would overstate the layer time
    due, layer_time = pace.due(16)  # type: ignore[misc]
    assert layer_time == pytest.approx(0.03) and due == pytest.approx(100.0 + 0.061 + 13 * 0.03)
    pace.note(1, 0.031, now=100.5)  # out of order: the first and last reported layers stay the bounds
    assert pace.due(16) == pytest.approx((due, layer_time))


def test_doorbell_wakes_a_waiting_watcher_and_is_only_a_hint() -> None:
    """The bell's ``wait`` ends as soon as a datagram comes and drains a flood in one wake (bounded); rings to no
    bell, to a closed port, or into a closed bell never raise, so a lost ring only costs the poll it would have
    saved."""
    import threading

    from kvtransfer.nixl_agent import Doorbell, Ringer, split_endpoint

    assert split_endpoint("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert split_endpoint("[::1]:7") == ("::1", 7)
    for bad in ("nixl://agent", "host:", ":80", "h:0", "h:70000", ""):
        assert split_endpoint(bad) is None, bad
    bell, ringer = Doorbell("127.0.0.1"), Ringer()
    try:
        address = split_endpoint(bell.endpoint)
        assert bell.wait(0.01) is False and bell.rings == 0
        timer = threading.Timer(0.05, ringer.ring, args=(address,))
        t0 = time.monotonic()
        timer.start()
        assert bell.wait(5.0) is True
        assert time.monotonic() - t0 < 2.0 and bell.rings == 1
        for _ in range(10):
            ringer.ring(address)
        time.sleep(0.05)
        assert bell.wait(1.0) is True  # one wake for the burst, drained
        assert bell.wait(0.02) is False and bell.rings == 2
        ringer.ring(None)
        probe = Doorbell("127.0.0.1")
        gone = split_endpoint(probe.endpoint)
        probe.close()
        ringer.ring(gone)  # nobody listens: still no exception
    finally:
        bell.close()
        ringer.close()
    assert bell.wait(0.01) is False  # closed: a plain (short) sleep's end


def test_the_last_written_layer_rings_the_receivers_doorbell_instead_of_waiting_out_its_sleep() -> None:
    """NIXL cannot block on notifications, so the receiver sleeps between polls (up to 20 ms by its schedule). A
    short transfer lands inside such a sleep. The sender rings the receiver's UDP doorbell once its last layer's
    WRITE is complete, so the receiver sees the transfer DONE within milliseconds. To show that the ring is what
    wakes it, the watcher's every sleep is made 0.3 s here: with the ring, DONE still comes within milliseconds;
    with the ring dropped (the same transfers), only when that sleep ends. Medians of 3; the first transfer, which
    adds the remote agents, is not counted."""
    import statistics

    r, s = NixlReceiver(), NixlSender()
    r._next_sleep = lambda now, pace: 0.3  # type: ignore[method-assign]
    done_at: dict[str, float] = {}

    def on_done(rid: str) -> None:
        done_at.setdefault(rid, time.perf_counter())

    r.set_on_done(on_done)
    ring = s._ringer.ring
    took: dict[bool, list[float]] = {True: [], False: []}
    try:
        r.register(make_caches(LAYOUT, 8, None), LAYOUT)
        s.register(make_caches(LAYOUT, 8, 3), LAYOUT)
        for i, with_bell in enumerate([True, True, True, True, False, False, False]):
            s._ringer.ring = ring if with_bell else (lambda address: None)  # type: ignore[method-assign]
            rid = f"bell-{i}"
            d = r.reserve(rid, [1, 2], 8, time.time() + 20)
            time.sleep(0.02)  # the watcher is asleep
            t0 = time.perf_counter()
            s.start(rid, d, [4, 5], time.time() + 20)
            for layer in range(LAYOUT.num_layers):
                s.send_layer(rid, layer)
            s.finish(rid)
            end = time.monotonic() + 10
            while rid not in done_at and time.monotonic() < end:
                time.sleep(0.001)
            assert r.poll(rid).state == TransferState.DONE
            if i:
                took[with_bell].append(done_at[rid] - t0)
            s.release(rid)
            r.release(rid)
    finally:
        s.close()
        r.close()
    assert r._bell.rings >= 4
    assert statistics.median(took[True]) < 0.05, took
    assert statistics.median(took[False]) > 0.1, took
