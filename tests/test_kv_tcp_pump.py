"""The tcp sender's native writer (``kvtransfer/tcp_pump.c``, issue 32): real sockets, real threads.

The pump writes pushed buffers in order, through partial sends, straight from the memory it was handed; a send
that cannot finish by its deadline cuts the connection both ways and refuses later pushes; and a real tcp transfer
between two processes lands bit-exact with the native writer on and with the Python worker (``native_io=False``).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from bench.kv_peer import Peer
from kvtransfer import KVLayout, TransferConfig, TransferState
from kvtransfer.tcp import TcpSender, pump_module

PUMP = pump_module()
needs_pump = pytest.mark.skipif(PUMP is None, reason="the native writer could not be built here")
LAYOUT = KVLayout("tiny-llama", "float16", num_layers=4, block_size=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 32


def _read_all(sock: socket.socket, want: int, got: bytearray, slow: bool) -> None:
    while len(got) < want:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return
        got.extend(chunk)
        if slow:
            time.sleep(0.0005)  # a slow reader: the pump's sends end mid-buffer and wait for room


@needs_pump
@pytest.mark.timeout(60)
def test_pump_writes_every_buffer_in_order_through_partial_sends() -> None:
    assert PUMP is not None
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(0.2)  # as the sender's sockets are: non-blocking underneath, the pump polls for room
    pump = PUMP.Pump(a.fileno())
    gen = torch.Generator().manual_seed(5)
    tensor = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen)
    view = tensor.numpy().data.cast("B")  # a memoryview of tensor memory, as the sender's payloads are
    items: list[list[bytes | memoryview]] = [[b"h" * 40, view[: 1 << 20]], [b"", bytes(range(200)) * 7],
                                             [view[1 << 20 :], b"f" * 40]]
    want = b"".join(bytes(x) for item in items for x in item)
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(b, len(want), got, True))
    reader.start()
    try:
        for item in items:
            assert pump.push(item, time.monotonic() + 30)
        del view, items  # the pump holds what it still has to send
        assert pump.drain(30)
        reader.join(30)
        assert bytes(got) == want
        assert pump.state() == (len(want), len(want), None)
    finally:
        pump.close()
        a.close()
        b.close()


@needs_pump
@pytest.mark.timeout(60)
def test_pump_past_its_deadline_cuts_the_connection_and_refuses_more() -> None:
    """A peer that never reads: the send ends at the deadline, the socket is shut down both ways (a reader
    blocked on it, like the sender's ACK reader, sees the end at once) and later pushes are refused."""
    assert PUMP is not None
    a, b = socket.socketpair()
    a.settimeout(0.2)
    pump = PUMP.Pump(a.fileno())
    ended = threading.Event()

    def ack_reader() -> None:
        a.settimeout(None)
        if a.recv(1) == b"":
            ended.set()

    reader = threading.Thread(target=ack_reader)
    reader.start()
    try:
        t0 = time.monotonic()
        assert pump.push([b"x" * (64 << 20)], time.monotonic() + 0.5)
        assert ended.wait(10)
        assert time.monotonic() - t0 < 5
        assert pump.state()[2] == "deadline passed during the send"
        assert pump.push([b"more"], time.monotonic() + 5) is False
        assert pump.drain(1) is False
    finally:
        pump.close()
        reader.join(5)
        a.close()
        b.close()


def test_sender_uses_the_native_writer_only_where_asked_and_built() -> None:
    on = TcpSender(TransferConfig())
    off = TcpSender(TransferConfig(native_io=False))
    try:
        assert on.native == (PUMP is not None)
        assert off.native is False
    finally:
        on.close()
        off.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("native_io", [True, False])
def test_transfer_lands_bit_exact_with_either_writer(native_io: bool) -> None:
    """Two requests in flight at once, non-contiguous blocks, both writers: the receiver's blocks hold the
    sender's bytes exactly, both ends DONE."""
    config = {"native_io": native_io}
    r = Peer("tcp", "receiver", LAYOUT, NUM_BLOCKS, wait=False, config=config)
    s = Peer("tcp", "sender", LAYOUT, NUM_BLOCKS, seed=11, wait=False, config=config)
    try:
        r.wait_ready()
        s.wait_ready()
        reqs = {"a": ([0, 1, 2, 7, 8], [3, 4, 9, 10, 11], 18), "b": ([12, 13, 20, 21], [30, 5, 6, 7], 15)}
        for rid, (src, dst, ntok) in reqs.items():
            dest = r.call("reserve", rid, dst, ntok, time.time() + 20)
            s.call("start", rid, [dest], src, time.time() + 20)
        for layer in range(LAYOUT.num_layers):
            for rid in reqs:
                s.call("send_layer", rid, layer)
        for rid in reqs:
            s.call("finish", rid)
        for rid, (src, dst, _) in reqs.items():
            assert r.call("wait", rid, 15)[0] == TransferState.DONE
            assert s.call("wait", rid, 15)[0] == TransferState.DONE
            assert s.call("digest", src) == r.call("digest", dst)
    finally:
        s.kill()
        r.kill()
