"""torch.distributed plumbing shared by both ends: the pair's process group, store clients, and the control
connection that carries its wire frames. Design: :mod:`kvtransfer.torch_dist`."""

from __future__ import annotations

import datetime
import socket
import struct
import threading
from typing import Any

import torch
from torch.distributed import TCPStore

from kvtransfer.io_cpus import io_affinity
from kvtransfer.sockio import close_socket, recv_exact, send_nowait, send_vectored, tune
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, unpack

PAIRS_KEY = "tandem/pairs"
CONTROL_KEY = "tandem/control"  # the receiver's control listener, host:port
TAG = 0


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_group(store: Any, rank: int, cuda: bool, timeout_s: float, io_cpus: tuple[int, ...] = ()) -> Any:
    """A 2-rank process group on ``store``: NCCL for CUDA tensors, gloo (bound to the store's host) otherwise. The
    library threads it starts (gloo's device loop, which reads every received byte, and its work threads) run on
    ``io_cpus``."""
    with io_affinity(io_cpus):
        return _make_group(store, rank, cuda, timeout_s)


def _make_group(store: Any, rank: int, cuda: bool, timeout_s: float) -> Any:
    if cuda:  # pragma: no cover - needs a GPU
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timedelta_s(timeout_s)
        return ProcessGroupNCCL(store, rank, 2, opts)
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta_s(timeout_s)
    return ProcessGroupGloo(store, rank, 2, opts)


def split_frames(blob: bytes) -> list[tuple[Frame, bytes]]:
    """Frames of one store message; control payloads are inline, DATA payloads come through the group."""
    out: list[tuple[Frame, bytes]] = []
    off = 0
    while off < len(blob):
        frame = unpack(blob[off : off + HEADER_SIZE])
        off += HEADER_SIZE
        if frame.kind == Kind.DATA:
            out.append((frame, b""))
            continue
        out.append((frame, blob[off : off + frame.payload_len]))
        off += frame.payload_len
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_LEN = struct.Struct("!I")
PAIR_INDEX = struct.Struct("!Q")  # a control connection's first message: the pair index its sender claimed
MAX_MESSAGE = 64 << 20  # a control message is wire frames: a layer's DATA headers at most, far below this


class ControlLink:
    """A pair's control channel: one TCP connection carrying length-prefixed messages of wire frames both ways.

    Reads block (no polling: a message is seen the moment it lands) and end with :class:`PeerClosed` on EOF, which
    a killed peer's kernel delivers at once, or ``InterruptedError`` once ``stop`` is set and :meth:`close` shut the
    socket. One thread reads; any thread may ``put`` (writes are serialised). A write is bounded by ``deadline``; a
    partial write leaves the stream unusable, so any write error cuts the connection.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        tune(sock, None)
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self._len = bytearray(_LEN.size)

    def put(self, blob: bytes, deadline: float) -> None:
        with self._send_lock:
            try:
                send_vectored(self.sock, [_LEN.pack(len(blob)), blob], deadline)
            except OSError:
                self.close()
                raise

    def put_nowait(self, blob: bytes) -> None:
        """A small reply (ACK/FAIL) from a thread that must never block (the receiver, its lease reaper)."""
        data = _LEN.pack(len(blob)) + blob
        with self._send_lock:
            if not send_nowait(self.sock, data):
                self.close()
                raise ConnectionError(f"control message to {self.peer} would block; connection cut")

    def get(self, stop: threading.Event) -> bytes:
        recv_exact(self.sock, memoryview(self._len), stop, at_boundary=True)
        (n,) = _LEN.unpack(self._len)
        if n > MAX_MESSAGE:
            raise ValueError(f"control message of {n} bytes from {self.peer} is too large")
        blob = bytearray(n)
        recv_exact(self.sock, memoryview(blob), stop)
        return bytes(blob)

    def close(self) -> None:
        close_socket(self.sock)


def store_client(endpoint: str, timeout_s: float) -> TCPStore:
    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timedelta_s(timeout_s), wait_for_workers=False)
