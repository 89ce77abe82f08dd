"""torch.distributed plumbing shared by both ends: the pair's process group, store clients, the ordered store
queue that carries control frames. Design: :mod:`kvtransfer.torch_dist`."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
from torch.distributed import TCPStore

from kvtransfer.pacing import Backoff
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, unpack

PAIRS_KEY = "tandem/pairs"
TAG = 0


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_group(store: Any, rank: int, cuda: bool, timeout_s: float) -> Any:
    """A 2-rank process group on ``store``: NCCL for CUDA tensors, gloo (bound to the store's host) otherwise."""
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


class StoreQueue:
    """An ordered message queue in the store: ``put`` from one side, ``get`` in order on the other.

    ``get`` polls with ``check`` instead of a timed ``wait``: a timed-out wait logs a C++ warning every time.
    """

    def __init__(self, store: Any, name: str) -> None:
        self.store, self.name = store, name
        self._put = 0
        self._get = 0
        self._lock = threading.Lock()

    def put(self, blob: bytes) -> None:
        with self._lock:
            self.store.set(f"{self.name}/{self._put}", blob)
            self._put += 1

    def get(self, timeout_s: float, pace: Backoff, stop: threading.Event) -> bytes | None:
        """The next message, or None after ``timeout_s``. Raises ``DistNetworkError`` when the store is gone."""
        key = f"{self.name}/{self._get}"
        end = time.monotonic() + timeout_s
        with self._lock:
            while not self.store.check([key]):
                if time.monotonic() >= end or pace.wait(stop):
                    return None
            pace.reset()
            blob = self.store.get(key)
            self.store.delete_key(key)
            self._get += 1
        return bytes(blob)


def store_client(endpoint: str, timeout_s: float) -> TCPStore:
    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timedelta_s(timeout_s), wait_for_workers=False)
