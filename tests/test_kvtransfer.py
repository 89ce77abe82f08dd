"""kvtransfer: layout contract, TP head mapping, hand-off encoding, leases, and real two-process transfers.

Cross-process tests start a decode (receiver) and a prefill (sender) child per backend with the spawn context,
on 127.0.0.1 only; every child is killed by PID in teardown and every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import pickle
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from bench.kv_peer import Peer, digest, make_caches
from kvtransfer import (
    CompatibilityError,
    DestinationInfo,
    KVLayout,
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferState,
    backend_names,
    block_runs,
    get_backend,
)
from kvtransfer.book import TransferBook
from kvtransfer.fake import FakeBehaviour, FakeReceiver, FakeSender
from kvtransfer.layout import paired_runs
from kvtransfer.plan import HeadSlice, merge_heads, slice_heads, tp_head_map
from kvtransfer.sockio import IOV_CHUNK, send_vectored

HAS_NIXL = importlib.util.find_spec("nixl") is not None
LAYOUT = KVLayout("tiny-llama", "float16", num_layers=4, block_size=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 32
# Two requests; source and destination runs are deliberately different and non-contiguous.
REQUESTS = {
    "req-a": ([0, 1, 2, 7, 8], [3, 4, 9, 10, 11], 18),
    "req-b": ([12, 13, 20, 21], [30, 5, 6, 7], 15),
}


def wait_until(pred: Callable[[], bool], timeout_s: float, tick_s: float = 0.005) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(tick_s)
    return pred()


def state(peer: Peer, rid: str) -> tuple[int, str | None, int, int]:
    return peer.call("poll", rid)


# ------------------------------------------------------------------------------------------------ unit: layout
def test_block_runs_split_consecutive_ids_in_request_order() -> None:
    """Consecutive block ids collapse into (start, length) runs; order is kept, gaps and jumps split."""
    assert block_runs([4, 5, 6, 9, 2, 3]) == [(4, 3), (9, 1), (2, 2)]
    assert block_runs([]) == []
    assert paired_runs([0, 1, 2, 7], [5, 6, 9, 10]) == [(0, 5, 2), (2, 9, 1), (7, 10, 1)]
    with pytest.raises(ValueError, match="negative"):
        block_runs([1, -1])


def test_layout_validation_and_hash_ignore_tp() -> None:
    """Invalid layouts raise ValueError; the compatibility hash covers everything except TP."""
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("m", "float64", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="split evenly"):
        KVLayout("m", "float16", 1, 16, 6, 64, tp_size=4)
    with pytest.raises(ValueError, match="layout"):
        KVLayout("m", "float16", 1, 16, 8, 64, layout="NHBD")
    tp2 = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=1)
    assert tp2.compat_hash() == LAYOUT.compat_hash()
    LAYOUT.check_compatible(tp2)
    assert dataclasses.replace(LAYOUT, block_size=8).compat_hash() != LAYOUT.compat_hash()


@pytest.mark.parametrize(
    ("change", "field"),
    [({"model_id": "other"}, "model_id"), ({"dtype": "bfloat16"}, "dtype"), ({"block_size": 8}, "block_size"),
     ({"head_dim": 32}, "head_dim"), ({"num_kv_heads": 4}, "num_kv_heads"), ({"num_layers": 2}, "num_layers")],
)
def test_check_compatible_names_the_mismatching_field(change: dict[str, object], field: str) -> None:
    """A mismatch raises CompatibilityError (a ValueError) whose message names the field and both values."""
    with pytest.raises(CompatibilityError, match=field):
        LAYOUT.check_compatible(dataclasses.replace(LAYOUT, **change))  # type: ignore[arg-type]  # one field each


# -------------------------------------------------------------------------------------------- unit: tp mapping
@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "expected"),
    [
        (1, 1, {0: [(0, (0, 8), (0, 8))]}),
        (1, 2, {0: [(0, (0, 4), (0, 4))], 1: [(0, (4, 8), (0, 4))]}),
        (2, 1, {0: [(0, (0, 4), (0, 4)), (1, (0, 4), (4, 8))]}),
        (2, 4, {0: [(0, (0, 2), (0, 2))], 1: [(0, (2, 4), (0, 2))], 2: [(1, (0, 2), (0, 2))],
                3: [(1, (2, 4), (0, 2))]}),
        (4, 2, {0: [(0, (0, 2), (0, 2)), (1, (0, 2), (2, 4))], 1: [(2, (0, 2), (0, 2)), (3, (0, 2), (2, 4))]}),
    ],
)
def test_tp_head_map_lists_source_ranks_and_slices_per_destination_rank(
    src_tp: int, dst_tp: int, expected: dict[int, list[tuple[int, tuple[int, int], tuple[int, int]]]]
) -> None:
    """For 8 KV heads: each destination rank gets (src rank, src-local heads, dst-local heads) pieces."""
    got = tp_head_map(8, src_tp, dst_tp)
    assert {d: [(p.src_rank, p.src_heads, p.dst_heads) for p in ps] for d, ps in got.items()} == expected


def test_tp_mapping_refuses_uneven_splits_clearly() -> None:
    """Head counts that do not divide by a TP degree, or TP above the head count, are refused by name."""
    with pytest.raises(ValueError, match="cannot be split evenly across destination tp=3"):
        tp_head_map(8, 2, 3)
    with pytest.raises(ValueError, match="exceeds 2 KV heads"):
        tp_head_map(2, 1, 4)


def test_slice_and_merge_heads_round_trip_across_tp() -> None:
    """Slicing a TP=1 run for two TP=2 ranks and merging them back reproduces the run exactly."""
    run = torch.randn(3, 4, 8, 16)
    full = torch.zeros_like(run)
    for d, pieces in tp_head_map(8, 1, 2).items():
        shard = torch.zeros(3, 4, 4, 16)
        for p in pieces:
            merge_heads(shard, slice_heads(run, p), p)
        back = HeadSlice(d, 0, p.global_heads, (0, 4), p.global_heads)
        merge_heads(full, slice_heads(shard, back), back)
    assert torch.equal(full, run)


# ------------------------------------------------------------------------------------------- unit: hand-off
def _dest(**over: object) -> DestinationInfo:
    base = dict(backend="tcp", request_id="r", transfer_id=7, endpoint="127.0.0.1:1", layout=LAYOUT,
                dst_block_ids=(3, 4, 9), num_tokens=10, deadline_s=123.5, compat_hash=LAYOUT.compat_hash(),
                agent_metadata=b"\x00\xffmeta", regions=tuple((i, i + 1) for i in range(4)))
    base.update(over)
    return DestinationInfo(**base)  # type: ignore[arg-type]


def test_destination_info_round_trips_through_json_bytes() -> None:
    """to_bytes/from_bytes is lossless (binary metadata included) and the encoding is JSON, not pickle."""
    d = _dest()
    blob = d.to_bytes()
    assert DestinationInfo.from_bytes(blob) == d
    assert json.loads(blob)["version"] == 1


def test_destination_info_refuses_pickle_tampering_and_bad_fields() -> None:
    """Pickled blobs, a compat hash that does not match the layout, wrong versions and block counts are refused."""
    d = _dest()
    with pytest.raises(ValueError, match="JSON"):
        DestinationInfo.from_bytes(pickle.dumps(d.to_bytes()))
    doc = json.loads(d.to_bytes())
    for key, value, msg in [("compat_hash", "0" * 16, "tampered"), ("version", 2, "version"),
                            ("dst_block_ids", [1, 2], "blocks"), ("transfer_id", "7", "transfer_id")]:
        bad = dict(doc, **{key: value})
        with pytest.raises(ValueError, match=msg):
            DestinationInfo.from_bytes(json.dumps(bad).encode())


def test_registry_knows_every_backend_and_refuses_unknown_names() -> None:
    """get_backend returns (sender_cls, receiver_cls) by name; an unknown name lists the known ones."""
    assert set(backend_names()) == {"nixl", "torch", "tcp", "fake"}
    for name in ("torch", "tcp", "fake") + (("nixl",) if HAS_NIXL else ()):
        s, r = get_backend(name)
        assert s.backend_name == r.backend_name == name
    with pytest.raises(ValueError, match="known: nixl, torch, tcp, fake"):
        get_backend("rdma")


def test_transfer_config_validates() -> None:
    """Config is frozen and validated with ValueError."""
    with pytest.raises(ValueError, match="port"):
        TransferConfig(port=70000)
    with pytest.raises(ValueError, match="close_timeout_s"):
        TransferConfig(io_timeout_s=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransferConfig().port = 1  # type: ignore[misc]


def test_ucx_environment_pins_loopback_and_leaves_transports_to_ucx_unless_named() -> None:
    """UCX picks the transports by default (shared memory on one host: the sender copies, the receiver's CPU is
    free); a config that names transports gets exactly those, and loopback is always pinned unless cleared."""
    from kvtransfer.nixl_agent import ucx_environment

    assert TransferConfig().ucx_tls == ""
    assert ucx_environment(TransferConfig()) == {"UCX_NET_DEVICES": "lo"}
    assert ucx_environment(TransferConfig(ucx_tls="tcp,self")) == {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"}
    assert ucx_environment(TransferConfig(ucx_net_devices="", ucx_tls="rc,cuda_copy")) == {"UCX_TLS": "rc,cuda_copy"}


# ------------------------------------------------------------------------------------ in-process: fake backend
@pytest.fixture
def fake_pair() -> Iterator[tuple[FakeSender, FakeReceiver, list, list]]:
    failures: list[tuple[str, str]] = []
    src, dst = make_caches(LAYOUT, NUM_BLOCKS, 1), make_caches(LAYOUT, NUM_BLOCKS, None)
    r = FakeReceiver(on_failed=lambda rid, msg: failures.append((rid, msg)))
    s = FakeSender(on_failed=lambda rid, msg: failures.append((rid, msg)))
    r.register(dst, LAYOUT)
    s.register(src, LAYOUT)
    yield s, r, src, dst
    s.close()
    r.close()


def test_fake_copies_two_requests_exactly_layer_by_layer(fake_pair: tuple) -> None:
    """The fake backend lands 2 requests × 4 layers into non-contiguous blocks exactly, one layer at a time."""
    s, r, src, dst = fake_pair
    for rid, (src_ids, dst_ids, ntok) in REQUESTS.items():
        d = r.reserve(rid, dst_ids, ntok, time.time() + 10)
        s.start(rid, d, src_ids, time.time() + 10)
        for layer in range(LAYOUT.num_layers):
            s.send_layer(rid, layer)
            assert r.poll(rid).layers_done == layer + 1
        s.finish(rid)
        assert r.poll(rid).state == s.poll(rid).state == TransferState.DONE
        assert digest(src, src_ids) == digest(dst, dst_ids)


def test_fake_injected_failure_reaches_both_sides_with_a_message(fake_pair: tuple) -> None:
    """A loud sender failure at layer 2 marks both sides FAILED with the injected message."""
    _, r, src, _ = fake_pair
    s = FakeSender(behaviour=FakeBehaviour(fail_at_layer=2, message="boom at layer 2"))
    s.register(src, LAYOUT)
    try:
        d = r.reserve("x", [1, 2], 8, time.time() + 10)
        s.start("x", d, [5, 6], time.time() + 10)
        for layer in range(4):
            s.send_layer("x", layer)
        assert s.poll("x").state == TransferState.FAILED and "boom" in (s.poll("x").error or "")
        assert wait_until(lambda: r.poll("x").state == TransferState.FAILED, 2)
        assert "boom at layer 2" in (r.poll("x").error or "")
        assert r.poll("x").layers_done == 2
    finally:
        s.close()


def test_on_done_tells_each_side_once_when_a_transfer_is_done_and_never_when_it_fails(fake_pair: tuple) -> None:
    """``set_on_done`` callbacks fire once per DONE transfer with its request id (what lets a worker's idle engine
    loop react at once instead of at its next tick), and not for a released, failed one."""
    s, r, _, _ = fake_pair
    done: list[tuple[str, str]] = []
    s.set_on_done(lambda rid: done.append(("sender", rid)))
    r.set_on_done(lambda rid: done.append(("receiver", rid)))
    d = r.reserve("ok", [1, 2], 8, time.time() + 10)
    s.start("ok", d, [5, 6], time.time() + 10)
    for layer in range(LAYOUT.num_layers):
        s.send_layer("ok", layer)
    s.finish("ok")
    assert wait_until(lambda: len(done) == 2, 2)
    assert sorted(done) == [("receiver", "ok"), ("sender", "ok")]
    d = r.reserve("gone", [3, 4], 8, time.time() + 10)
    s.start("gone", d, [7, 8], time.time() + 10)
    s.send_layer("gone", 0)
    s.release("gone")
    assert wait_until(lambda: r.poll("gone").state == TransferState.FAILED, 2)
    assert len(done) == 2


def test_a_raising_on_done_callback_is_logged_and_the_transfer_still_done() -> None:
    book = TransferBook("sender", None)

    def boom(_rid: str) -> None:
        raise RuntimeError("callback bug")

    book.on_done = boom
    entry = book.add("x", time.time() + 10)
    assert book.done(entry) and entry.state == TransferState.DONE
    assert not book.done(entry)  # fires once: a second transition is refused


def test_reaper_sleeps_until_the_earliest_deadline_and_a_nearer_one_wakes_it() -> None:
    """The lease reaper does not tick while nothing is due (on a decode worker every tick was CPU taken from the
    decode loop), yet expires each lease on time: a later, nearer deadline wakes it, and a failure is delivered
    at once. Nobody polls the book here, so only the reaper can have expired the entries."""
    failed: list[tuple[str, float]] = []
    book = TransferBook("receiver", lambda rid, _msg: failed.append((rid, time.monotonic())))
    passes = [0]
    expire_due = book.expire_due

    def counted() -> float | None:
        passes[0] += 1
        return expire_due()

    book.expire_due = counted  # type: ignore[method-assign]
    book.start(TransferConfig(poll_interval_s=0.002))
    try:
        book.add("far", time.time() + 30)
        time.sleep(0.1)
        for i in range(50):  # leases of seconds, as requests carry, due after the reaper's next look: no wake-up
            book.add(f"later-{i}", time.time() + 30)
            time.sleep(0.002)
        time.sleep(0.1)
        assert passes[0] <= 3, f"the reaper ticked {passes[0]} times in 0.3 s with nothing due"
        t0 = time.monotonic()
        book.add("near", time.time() + 0.15)
        assert wait_until(lambda: bool(failed), 2)
        assert failed[0][0] == "near" and 0.14 <= failed[0][1] - t0 < 0.4, failed
        assert book.get("far").state < TransferState.DONE
        t1 = time.monotonic()
        book.fail(book.get("far"), "receiver: refused")
        assert wait_until(lambda: len(failed) == 2, 1) and failed[1][1] - t1 < 0.1, failed
    finally:
        book.stop(1.0)


def test_stalled_transfer_expires_its_lease_on_both_sides_and_calls_on_failed(fake_pair: tuple) -> None:
    """A silent stall is caught by the lease: both sides FAILED "lease expired" and on_failed fires."""
    _, r, src, _ = fake_pair
    calls: list[tuple[str, str]] = []
    s = FakeSender(on_failed=lambda rid, msg: calls.append((rid, msg)), behaviour=FakeBehaviour(stall_from_layer=1))
    s.register(src, LAYOUT)
    try:
        d = r.reserve("slow", [1, 2], 8, time.time() + 0.4)
        s.start("slow", d, [5, 6], time.time() + 30)  # sender deadline is capped by the receiver's lease
        for layer in range(4):
            s.send_layer("slow", layer)
        s.finish("slow")
        assert wait_until(lambda: r.poll("slow").state == TransferState.FAILED, 3)
        assert wait_until(lambda: s.poll("slow").state == TransferState.FAILED, 3)
        assert "lease expired" in (r.poll("slow").error or "")
        assert "lease expired" in (s.poll("slow").error or "")
        assert wait_until(lambda: bool(calls), 2) and calls[0][0] == "slow"
    finally:
        s.close()


def test_released_receiver_discards_late_bytes(fake_pair: tuple) -> None:
    """After release, bytes still sent for that request are never written into the (now reusable) blocks."""
    s, r, _, dst = fake_pair
    d = r.reserve("gone", [1, 2], 8, time.time() + 10)
    s.start("gone", d, [5, 6], time.time() + 10)
    r.release("gone")
    s.send_layer("gone", 0)
    assert not dst[0][0][1:3].any()


@pytest.mark.parametrize("backend", ["tcp", "fake"])
def test_tp2_prefill_into_tp1_decode_merges_heads(backend: str) -> None:
    """Two prefill ranks (TP=2) each send their head half into one decode rank (TP=1); result equals the full KV.
    On tcp the receiver takes these head-sliced pieces through its staging path."""
    sender_cls, receiver_cls = get_backend(backend)
    full = make_caches(LAYOUT, NUM_BLOCKS, 3)
    r = receiver_cls()
    dst = make_caches(LAYOUT, NUM_BLOCKS, None)
    r.register(dst, LAYOUT)
    senders: list[KVSender] = []
    try:
        d = r.reserve("tp", [4, 5, 9], 12, time.time() + 10)
        for rank in range(2):
            lay = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=rank)
            shard = [(k[:, :, rank : rank + 1].contiguous(), v[:, :, rank : rank + 1].contiguous()) for k, v in full]
            s = sender_cls()
            s.register(shard, lay)
            s.start("tp", d, [0, 1, 2], time.time() + 10)
            senders.append(s)
        for layer in range(4):
            for s in senders:
                s.send_layer("tp", layer)
        for s in senders:
            s.finish("tp")
        assert wait_until(lambda: r.poll("tp").finished, 10), r.poll("tp")
        assert r.poll("tp").state == TransferState.DONE
        assert digest(full, [0, 1, 2]) == digest(dst, [4, 5, 9])
    finally:
        sides: list[KVSender | KVReceiver] = [*senders, r]
        for side in sides:
            side.close()


@pytest.mark.parametrize("backend", ["tcp", "fake"])
def test_tp1_prefill_into_tp2_decode_sends_each_rank_its_heads(backend: str) -> None:
    """One prefill rank (TP=1) with two destinations (decode TP=2) sends each its head half (strided receive)."""
    sender_cls, receiver_cls = get_backend(backend)
    full = make_caches(LAYOUT, NUM_BLOCKS, 4)
    receivers, dests, dsts = [], [], []
    for rank in range(2):
        lay = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=rank)
        r = receiver_cls()
        dst = make_caches(lay, NUM_BLOCKS, None)
        r.register(dst, lay)
        dests.append(r.reserve("tp", [6, 7, 20], 12, time.time() + 10))
        receivers.append(r)
        dsts.append(dst)
    s = sender_cls()
    s.register(full, LAYOUT)
    try:
        s.start("tp", dests, [0, 1, 2], time.time() + 10)
        for layer in range(4):
            s.send_layer("tp", layer)
        s.finish("tp")
        assert wait_until(lambda: s.poll("tp").finished, 10), s.poll("tp")
        assert s.poll("tp").state == TransferState.DONE
        for rank, dst in enumerate(dsts):
            want = [(k[:, :, rank : rank + 1].contiguous(), v[:, :, rank : rank + 1].contiguous()) for k, v in full]
            assert digest(want, [0, 1, 2]) == digest(dst, [6, 7, 20])
    finally:
        ends: list[KVSender | KVReceiver] = [s, *receivers]
        for x in ends:
            x.close()


@pytest.mark.parametrize("backend", ["tcp", "torch", "fake"] + (["nixl"] if HAS_NIXL else []))
def test_close_joins_background_threads_within_one_second(backend: str) -> None:
    """close() on an idle sender and receiver returns within 1 s each (threads are stoppable)."""
    sender_cls, receiver_cls = get_backend(backend)
    for cls in (sender_cls, receiver_cls):
        side = cls()
        side.register(make_caches(LAYOUT, 4, None), LAYOUT)
        t0 = time.monotonic()
        side.close()
        assert time.monotonic() - t0 < 1.0


# --------------------------------------------------------------------------------- two processes per backend
CROSS = ["tcp", "torch"] + (["nixl"] if HAS_NIXL else [])


@pytest.fixture(scope="module", params=CROSS)
def procs(request: pytest.FixtureRequest) -> Iterator[tuple[str, Peer, Peer]]:
    """A decode (receiver) child and a prefill (sender) child for one backend, started concurrently."""
    backend = request.param
    r = Peer(backend, "receiver", LAYOUT, NUM_BLOCKS, wait=False)
    s = Peer(backend, "sender", LAYOUT, NUM_BLOCKS, seed=7, wait=False)
    try:
        r.wait_ready()
        s.wait_ready()
        yield backend, s, r
    finally:
        for p in (s, r):
            p.kill()


def _send_all(s: Peer, rid: str, finish: bool = True) -> None:
    for layer in range(LAYOUT.num_layers):
        s.call("send_layer", rid, layer)
    if finish:
        s.call("finish", rid)


@pytest.mark.timeout(60)
def test_two_requests_land_bit_exact_in_noncontiguous_blocks(procs: tuple[str, Peer, Peer]) -> None:
    """Prefill sends 2 requests × 4 layers of random KV; decode's reserved blocks hold exactly the source bytes."""
    backend, s, r = procs
    for rid, (src_ids, dst_ids, ntok) in REQUESTS.items():
        rid = f"{backend}-{rid}"
        dest = r.call("reserve", rid, dst_ids, ntok, time.time() + 20)
        s.call("start", rid, [dest], src_ids, time.time() + 20)
        _send_all(s, rid)
    for rid, (src_ids, dst_ids, _) in REQUESTS.items():
        rid = f"{backend}-{rid}"
        assert r.call("wait", rid, 15)[0] == TransferState.DONE, state(r, rid)
        assert s.call("wait", rid, 15)[0] == TransferState.DONE, state(s, rid)
        assert s.call("digest", src_ids) == r.call("digest", dst_ids)


@pytest.mark.timeout(60)
def test_receiver_sees_layers_land_before_finish(procs: tuple[str, Peer, Peer]) -> None:
    """Each send_layer is visible at the receiver (layers_done grows 1, 2, 3, 4) before finish is called."""
    backend, s, r = procs
    rid = f"{backend}-layerwise"
    dest = r.call("reserve", rid, [14, 15, 16], 12, time.time() + 20)
    s.call("start", rid, [dest], [24, 25, 26], time.time() + 20)
    seen = []
    for layer in range(LAYOUT.num_layers):
        s.call("send_layer", rid, layer)
        assert wait_until(functools.partial(lambda n: state(r, rid)[3] > n, layer), 10), state(r, rid)
        seen.append(state(r, rid)[3])
    assert seen == [1, 2, 3, 4]
    s.call("finish", rid)
    assert s.call("wait", rid, 10)[0] == TransferState.DONE


@pytest.mark.timeout(60)
def test_compatibility_mismatch_is_refused_on_both_sides_naming_the_field(procs: tuple[str, Peer, Peer]) -> None:
    """A destination whose layout differs (dtype) is refused at start, and the receiver FAILs naming "dtype"."""
    backend, s, r = procs
    rid = f"{backend}-mismatch"
    real = DestinationInfo.from_bytes(r.call("reserve", rid, [17, 18], 8, time.time() + 20))
    bad_layout = dataclasses.replace(real.layout, dtype="bfloat16")
    bad = dataclasses.replace(real, layout=bad_layout, compat_hash=bad_layout.compat_hash())
    with pytest.raises(RuntimeError, match=r"CompatibilityError.*dtype"):
        s.call("start", rid, [bad.to_bytes()], [1, 2], time.time() + 20)
    assert state(s, rid)[0] == TransferState.FAILED
    assert wait_until(lambda: state(r, rid)[0] == TransferState.FAILED, 10), state(r, rid)
    assert "dtype" in (state(r, rid)[1] or "")


@pytest.mark.timeout(60)
def test_sender_killed_mid_transfer_fails_the_receiver(procs: tuple[str, Peer, Peer]) -> None:
    """kill -9 of a prefill process after 2 of 4 layers: decode reports FAILED within the lease; tcp and torch (whose
    control frames come over a socket) at once, from the dead sender's EOF."""
    backend, _, r = procs
    lease = 2.0  # nixl's failure is the lease's expiry: the test waits it out
    victim = Peer(backend, "sender", LAYOUT, NUM_BLOCKS, seed=9)
    try:
        rid = f"{backend}-sender-dies"
        dest = r.call("reserve", rid, [0, 1, 2], 12, time.time() + lease)
        victim.call("start", rid, [dest], [3, 4, 5], time.time() + lease)
        for layer in range(2):
            victim.call("send_layer", rid, layer)
        assert wait_until(lambda: state(r, rid)[3] >= 2, lease)
        t0 = time.monotonic()
        victim.kill()
        at_once = backend in ("tcp", "torch")
        limit = 1.5 if at_once else lease + 1.0
        assert wait_until(lambda: state(r, rid)[0] == TransferState.FAILED, limit), state(r, rid)
        took = time.monotonic() - t0
        message = state(r, rid)[1] or ""
        assert ("connection lost" in message) if at_once else ("lease expired" in message or "lost" in message)
        assert took < limit
    finally:
        victim.kill()


@pytest.mark.timeout(60)
def test_receiver_killed_mid_transfer_fails_the_sender(procs: tuple[str, Peer, Peer]) -> None:
    """kill -9 of a decode process after layer 0: prefill reports FAILED within the lease, never hangs."""
    backend, s, _ = procs
    lease = 4.0
    victim = Peer(backend, "receiver", LAYOUT, NUM_BLOCKS)
    try:
        rid = f"{backend}-receiver-dies"
        dest = victim.call("reserve", rid, [0, 1, 2], 12, time.time() + lease)
        s.call("start", rid, [dest], [3, 4, 5], time.time() + lease)
        s.call("send_layer", rid, 0)
        assert wait_until(lambda: state(victim, rid)[3] >= 1, lease)
        victim.kill()
        for layer in range(1, LAYOUT.num_layers):
            s.call("send_layer", rid, layer)
        s.call("finish", rid)
        assert wait_until(lambda: state(s, rid)[0] == TransferState.FAILED, lease + 1.0), state(s, rid)
        assert state(s, rid)[1]
    finally:
        victim.kill()


def test_send_vectored_survives_partial_sends_and_more_buffers_than_one_call_takes() -> None:
    """Gathered writes (the TCP sender's frames): more buffers than one ``sendmsg`` takes, empty ones among them,
    through a small send buffer so calls end mid-buffer; the reader gets every byte in order."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    gen = torch.Generator().manual_seed(3)
    sizes = [int(x) for x in torch.randint(0, 3000, (IOV_CHUNK * 2 + 7,), generator=gen)]
    buffers = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    want = b"".join(buffers)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.0005)  # a slow reader: the writer's calls fill the buffer and return partial counts

    reader = threading.Thread(target=read)
    reader.start()
    try:
        mixed: list[bytes | memoryview] = [*buffers[:5], memoryview(buffers[5]), *buffers[6:]]
        assert send_vectored(a, mixed, time.monotonic() + 30) == len(want)
        reader.join(30)
        assert bytes(got) == want
    finally:
        a.close()
        b.close()


def test_send_vectored_to_a_peer_that_never_reads_ends_at_the_deadline() -> None:
    a, b = socket.socketpair()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            send_vectored(a, [b"x" * (1 << 20)] * 64, time.monotonic() + 0.5)
        assert time.monotonic() - t0 < 5
    finally:
        a.close()
        b.close()


def test_kv_bench_baselines_move_the_bytes_between_processes() -> None:
    """The raw baselines of ``tandem bench kv`` (a socket and a gloo pair, each a real second process) move the
    request's bytes and report a positive bandwidth; the gloo sink checks it got the bytes that were sent."""
    from bench.kv_bandwidth import bench_raw_gloo, bench_raw_socket

    for bench in (bench_raw_gloo, bench_raw_socket):
        gbps = bench(1 << 20, 2)
        assert 0 < gbps < float("inf"), (bench.__name__, gbps)


def test_kv_bench_takes_more_samples_of_small_requests() -> None:
    """A millisecond request's median is at the mercy of one late wake-up on 2 cores, so every side of the bench
    times at least 64 MiB per size: 64 requests of 1 MiB, 8 of 8 MiB, ``--repeats`` of 64 MiB."""
    from bench.kv_bandwidth import repeats_for

    assert [repeats_for(s, 5) for s in (1, 8, 64, 256)] == [64, 8, 5, 5]
    assert repeats_for(1, 100) == 100


def _is_cut(sock: socket.socket) -> bool:
    """Whether ``sock``'s peer has closed it (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def test_torch_receiver_refuses_a_control_connection_for_an_unclaimed_or_taken_pair() -> None:
    """The torch receiver's control port serves a connection only for a pair index claimed in its store, and each
    index once: one naming no claim, or one already connected, is cut at once while the first keeps its slot."""
    from kvtransfer.torch_dist import CONTROL_KEY, PAIR_INDEX, PAIRS_KEY, TorchReceiver, store_client

    receiver = TorchReceiver(TransferConfig(connect_timeout_s=5.0))
    store = store_client(receiver.endpoint, 5.0)
    host, port = store.get(CONTROL_KEY).decode().rsplit(":", 1)

    def connect(index: int) -> socket.socket:
        sock = socket.create_connection((host, int(port)), timeout=5.0)
        body = PAIR_INDEX.pack(index)
        sock.sendall(len(body).to_bytes(4, "big") + body)
        return sock

    def cut(sock: socket.socket, within_s: float) -> bool:
        sock.settimeout(within_s)
        try:
            return sock.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    socks: list[socket.socket] = []
    try:
        socks.append(connect(7))  # nothing claimed yet
        assert cut(socks[-1], 3.0)
        index = int(store.add(PAIRS_KEY, 1)) - 1
        # Two connections naming one claimed index: whichever the receiver serves first keeps it (and waits to
        # form its group), the other is cut. Each is served on its own thread, so either may be first.
        pair = [connect(index), connect(index)]
        socks += pair
        # the one cut is cut at once (readable: its EOF); the other, still open a second later, keeps its slot
        first, _, _ = select.select(pair, [], [], 3.0)
        assert sorted(cut(s, 3.0 if s in first else 1.0) for s in pair) == [False, True]
        kept = next(s for s in pair if s.fileno() >= 0 and not _is_cut(s))
        kept.settimeout(0.3)
        with pytest.raises(TimeoutError):
            kept.recv(1)
    finally:
        for s in socks:
            s.close()
        receiver.close()
