"""torch.distributed sender: joins the receiver's store, ``send``s each queued layer's block runs, completes on ACK.
Design: :mod:`kvtransfer.torch_dist`."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore

from kvtransfer.base import OnFailed
from kvtransfer.book import Entry
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.outgoing import Leg
from kvtransfer.queued_sender import QueuedSender
from kvtransfer.sockio import join_all
from kvtransfer.torch_group import (
    CONTROL_KEY,
    PAIR_INDEX,
    PAIRS_KEY,
    TAG,
    ControlLink,
    as_bytes,
    make_group,
    split_frames,
    store_client,
)
from kvtransfer.wire import Frame, Kind, control

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _OutPair:
    endpoint: str
    store: Any
    group: Any
    link: ControlLink
    legs: dict[int, tuple[Entry, Leg]] = field(default_factory=dict)
    alive: bool = True


@dataclass(eq=False)
class _PairWrites:
    """What one round of the worker sends a pair: one control message, then its payloads in the same order."""

    deadline: float  # the earliest of its requests'
    frames: list[bytes] = field(default_factory=list)
    payloads: list[torch.Tensor] = field(default_factory=list)
    layers: list[tuple[Entry, Leg, int]] = field(default_factory=list)  # (entry, leg, bytes) per layer gathered


def _writes(writes: dict[_OutPair, _PairWrites], pair: _OutPair, deadline: float) -> _PairWrites:
    w = writes.get(pair)
    if w is None:
        w = writes[pair] = _PairWrites(deadline)
    w.deadline = min(w.deadline, deadline)
    return w


class TorchSender(QueuedSender):
    backend_name: ClassVar[str] = "torch"
    cannot_reach: ClassVar[str] = "cannot form a group with"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self._pairs: dict[str, _OutPair] = {}
        self._inflight: list[tuple[_OutPair, list[Any], _PairWrites]] = []
        self._worker = start_io_thread(self.config.io_cpus, self._work, "kv-torch-send")
        self.book.start(self.config)

    def close(self) -> None:
        self._stop.set()
        self._queue.put(("stop", None, None))
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.link.close()  # ends the ACK readers' blocking reads
        join_all([self._worker, *self._threads], self.config.close_timeout_s)
        self.book.stop(self.config.close_timeout_s / 4)

    # ---- pairs
    def _peer(self, endpoint: str) -> _OutPair:
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is not None and pair.alive:
                return pair
            cfg = self.config
            store = store_client(endpoint, cfg.connect_timeout_s)
            index = int(store.add(PAIRS_KEY, 1)) - 1
            host, port = bytes(store.get(CONTROL_KEY)).decode().rsplit(":", 1)
            link = ControlLink(socket.create_connection((host, int(port)), cfg.connect_timeout_s), endpoint)
            try:
                link.put(PAIR_INDEX.pack(index), time.monotonic() + cfg.connect_timeout_s)
                cuda = bool(self.out.kv_caches) and self.out.kv_caches[0][0].is_cuda
                group = make_group(PrefixStore(f"tandem/pair/{index}", store_client(endpoint, cfg.connect_timeout_s)),
                                   1, cuda, cfg.connect_timeout_s, cfg.io_cpus)
            except Exception:
                link.close()
                raise
            pair = _OutPair(endpoint, store, group, link)
            self._pairs[endpoint] = pair
        t = start_io_thread(cfg.io_cpus, self._read, f"kv-torch-ack-{endpoint}", pair)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        return pair

    def _drop(self, pair: _OutPair, reason: str) -> None:
        with self._lock:
            pair.alive = False
            if self._pairs.get(pair.endpoint) is pair:
                del self._pairs[pair.endpoint]
        pair.link.close()  # the receiver sees EOF and fails its side of these requests at once
        self._fail_legs(pair, f"sender: {reason} ({pair.endpoint})")

    def _read(self, pair: _OutPair) -> None:
        try:
            while not self._stop.is_set() and pair.alive:
                for frame, payload in split_frames(pair.link.get(self._stop)):
                    self._on_reply(pair, frame, payload)
        except InterruptedError:
            return
        except Exception as e:
            if not self._stop.is_set():
                self._drop(pair, f"receiver connection lost (peer closed or killed): {e}".splitlines()[0])

    # ---- worker: the only thread that talks to groups
    def _work(self) -> None:
        while not self._stop.is_set():
            if self._queue.empty():
                self._complete()  # nothing queued behind: wait for the layers in flight
            batch = self._next_batch()
            if batch is None:
                continue
            writes: dict[_OutPair, _PairWrites] = {}
            try:
                for op, arg, extra in batch:
                    if op == "stop":
                        return
                    if op == "control":
                        _writes(writes, arg, time.monotonic() + self.config.connect_timeout_s).frames.append(extra)
                    elif op == "layer":
                        if extra is not None:  # pragma: no cover - needs a GPU
                            extra.synchronize()
                        self._gather_layer(writes, *arg)
                    elif op == "finish":
                        self._gather_finish(writes, arg)
            except Exception:  # never let one request kill the worker
                log.exception("kv torch sender: building a message failed")
            finally:
                self._flush(writes)

    def _gather_layer(self, writes: dict[_OutPair, _PairWrites], request_id: str, layer: int) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        k, v = self.out.kv_caches[layer]
        for leg in entry.ctx.legs:
            w = _writes(writes, leg.peer, entry.deadline)
            for p in leg.pieces:
                for kv, t in enumerate((k, v)):
                    w.frames.append(Frame(Kind.DATA, leg.dest.transfer_id, layer, kv, p.dst_start, p.num_blocks,
                                          p.dst_heads[0], p.dst_heads[1], p.nbytes).pack())
                    src = p.src_view(t)
                    w.payloads.append(as_bytes(src if src.is_contiguous() else src.contiguous()))
            w.layers.append((entry, leg, sum(p.nbytes for p in leg.pieces) * 2))

    def _gather_finish(self, writes: dict[_OutPair, _PairWrites], request_id: str) -> None:
        entry = self.out.live(request_id)
        if entry is None:
            return
        entry.ctx.finish_requested = True
        for leg in entry.ctx.legs:
            _writes(writes, leg.peer, entry.deadline).frames.append(control(Kind.FINISH, leg.dest.transfer_id))

    def _flush(self, writes: dict[_OutPair, _PairWrites]) -> None:
        """Per pair: one control message (every frame gathered, in queue order), then its payloads' ``send``s."""
        for pair, w in writes.items():
            if not pair.alive:
                continue
            try:
                pair.link.put(b"".join(w.frames), w.deadline)
                works = [pair.group.send([buf], 0, TAG) for buf in w.payloads]  # the receiver is rank 0
            except Exception as e:
                self._drop(pair, f"receiver connection lost (peer closed or killed): {e}".splitlines()[0])
                continue
            # Completed later (_complete), so the next message and its sends overlap these payloads.
            self._inflight.append((pair, works, w))

    def _complete(self) -> None:
        while self._inflight:
            pair, works, w = self._inflight.pop(0)
            try:
                for work in works:
                    work.wait()
            except Exception as e:
                self._drop(pair, f"receiver connection lost (peer closed or killed): {e}".splitlines()[0])
                continue
            for entry, leg, nbytes in w.layers:
                self.out.leg_sent_layer(entry, leg, nbytes)
