"""torch.distributed receiver: hosts the store, forms a group per sender, ``recv``s payloads into the reserved
blocks. Design: :mod:`kvtransfer.torch_dist`."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore, TCPStore

from kvtransfer.base import KVCaches, OnFailed
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.landing import Landing
from kvtransfer.layout import KVLayout
from kvtransfer.pacing import Backoff
from kvtransfer.stream_receiver import StreamReceiver
from kvtransfer.torch_group import (
    PAIRS_KEY,
    TAG,
    StoreQueue,
    as_bytes,
    make_group,
    split_frames,
    store_client,
    timedelta_s,
)
from kvtransfer.wire import Frame, Kind, control, parse_hello


@dataclass(eq=False)
class _InPair:
    index: int
    replies: StoreQueue
    alive: bool = True


class TorchReceiver(StreamReceiver):
    backend_name: ClassVar[str] = "torch"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        cfg = self.config
        self.book = TransferBook("receiver", on_failed, self._notify_peer)
        self.landing = Landing(self.book, self.backend_name)
        self._store: Any = TCPStore(cfg.host, cfg.port, None, True, timedelta_s(cfg.connect_timeout_s),
                                    wait_for_workers=False)
        self.endpoint = f"{cfg.host}:{self._store.port}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._cuda = False
        self._watcher = threading.Thread(target=self._watch, name="kv-torch-pairs", daemon=True)
        self._watcher.start()
        self.book.start(cfg.poll_interval_s)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)
        self._cuda = kv_caches[0][0].is_cuda

    def close(self) -> None:
        self._stop.set()
        end = time.monotonic() + self.config.close_timeout_s
        for t in [self._watcher, *self._threads]:
            t.join(max(0.0, end - time.monotonic()))
        self.book.stop(max(0.05, end - time.monotonic()))
        self._store = None  # the last reference to the master: its server shuts down

    def _watch(self) -> None:
        seen = 0
        while not self._stop.wait(max(self.config.poll_interval_s, 0.01)):
            try:
                claimed = int(self._store.add(PAIRS_KEY, 0))
            except Exception:  # store gone (closing)
                return
            for index in range(seen, claimed):
                t = threading.Thread(target=self._serve, args=(index,), name=f"kv-torch-pair-{index}", daemon=True)
                self._threads.append(t)
                t.start()
            seen = claimed

    def _serve(self, index: int) -> None:
        # One store client for the group and one for our queues: TCPStore clients are not safe for concurrent use.
        cfg = self.config
        name = f"tandem/pair/{index}"
        queues = PrefixStore(name, store_client(self.endpoint, cfg.connect_timeout_s))
        pair = _InPair(index, StoreQueue(queues, "r2s"))
        requests = StoreQueue(queues, "s2r")
        reason = "sender gone"
        pace = Backoff(cfg.poll_interval_s)
        try:
            group_store = PrefixStore(name, store_client(self.endpoint, cfg.connect_timeout_s))
            group = make_group(group_store, 0, self._cuda, cfg.connect_timeout_s)
            while not self._stop.is_set():
                blob = requests.get(cfg.io_timeout_s, pace, self._stop)
                if blob is None:
                    continue
                frames = split_frames(blob)
                data = [f for f, _ in frames if f.kind == Kind.DATA]
                if data:
                    self._data(pair, group, data)
                for frame, payload in frames:
                    if frame.kind != Kind.DATA:
                        self._dispatch(pair, frame, payload)
            reason = "receiver closed"
        except Exception as e:
            reason = f"sender connection lost (peer closed or killed): {e}".splitlines()[0]
        finally:
            pair.alive = False
            for entry in self.book.entries():
                if pair in entry.ctx.peers:
                    self.book.fail(entry, f"receiver: {reason} (pair {index})")

    def _dispatch(self, pair: _InPair, frame: Frame, payload: bytes) -> None:
        entry = self.landing.live(frame.transfer_id)
        if entry is None:
            if frame.kind == Kind.HELLO:
                pair.replies.put(control(Kind.FAIL, frame.transfer_id,
                                         b"receiver: no live reservation (released or lease expired)"))
            return
        if frame.kind == Kind.HELLO:
            try:
                self.landing.on_hello(entry, parse_hello(payload), pair)
            except ValueError as e:
                with self.book.lock:
                    if pair not in entry.ctx.peers:
                        entry.ctx.peers.append(pair)
                self.book.fail(entry, f"receiver: {e}", notify_peer=True)
        elif frame.kind == Kind.FINISH:
            self.landing.on_finish(entry)
        elif frame.kind == Kind.FAIL:
            self.book.fail(entry, f"receiver: sender reported: {payload.decode(errors='replace')}")

    def _data(self, pair: _InPair, group: Any, frames: list[Frame]) -> None:
        """Receive one layer message's payloads: all ``recv``s posted first, then waited on together.

        The sender sends every payload it announced no matter what, so each is received; it is written into the
        reserved blocks only while the lease is live and the header checks out (otherwise into a scratch buffer).
        """
        device = "cuda" if self._cuda else "cpu"
        slots: list[tuple[Frame, Entry | None, torch.Tensor | None, torch.Tensor]] = []
        try:
            for frame in frames:
                entry = self.landing.live(frame.transfer_id)
                view = None
                if entry is not None and self.book.begin_write(entry):
                    try:
                        view = self.landing.target(entry, frame)
                    except ValueError as e:
                        self.book.end_write(entry)
                        self.book.fail(entry, f"receiver: refused DATA: {e}", notify_peer=True)
                        entry = None
                else:
                    entry = None
                if view is not None and view.is_contiguous():
                    target = as_bytes(view)
                else:
                    target = torch.empty(frame.payload_len, dtype=torch.uint8, device=device)
                slots.append((frame, entry, view, target))
            works = [group.recv([target], 1, TAG) for _, _, _, target in slots]
            for w in works:
                w.wait()
            if self._cuda:  # pragma: no cover - needs a GPU
                torch.cuda.current_stream().synchronize()
            for _, _, view, target in slots:
                if view is not None and not view.is_contiguous():
                    view.copy_(target.view(view.dtype).view(view.shape))
        finally:
            for _, entry, _, _ in slots:
                if entry is not None:
                    self.book.end_write(entry)
        for frame, entry, _, _ in slots:
            if entry is not None and self.landing.landed(entry, frame.layer, frame.payload_len):
                for peer in list(entry.ctx.peers):
                    with contextlib.suppress(Exception):
                        peer.replies.put(control(Kind.ACK, frame.transfer_id))

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for peer in list(entry.ctx.peers):
            if peer.alive:
                peer.replies.put(control(Kind.FAIL, entry.ctx.transfer_id, message.encode()))
