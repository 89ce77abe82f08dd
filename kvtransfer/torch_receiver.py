"""torch.distributed receiver: hosts the store and a control listener, forms a group per sender,
``recv``s payloads into the reserved blocks. Design: :mod:`kvtransfer.torch_dist`."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore, TCPStore

from kvtransfer.base import KVCaches, OnFailed
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import io_affinity, start_io_thread
from kvtransfer.landing import Landing
from kvtransfer.layout import KVLayout
from kvtransfer.sockio import close_socket, join_all
from kvtransfer.stream_receiver import StreamReceiver
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
    timedelta_s,
)
from kvtransfer.wire import Frame, Kind, control, parse_hello


@dataclass(eq=False)
class _InPair:
    index: int
    link: ControlLink
    alive: bool = True


class TorchReceiver(StreamReceiver):
    backend_name: ClassVar[str] = "torch"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        cfg = self.config
        self.book = TransferBook("receiver", on_failed, self._notify_peer)
        self.landing = Landing(self.book, self.backend_name)
        with io_affinity(cfg.io_cpus):  # the store server's thread
            self._store: Any = TCPStore(cfg.host, cfg.port, None, True, timedelta_s(cfg.connect_timeout_s),
                                        wait_for_workers=False)
        self.endpoint = f"{cfg.host}:{self._store.port}"
        self._listener = socket.create_server((cfg.host, 0))
        self._listener.settimeout(cfg.io_timeout_s)
        self._store.set(CONTROL_KEY, f"{cfg.host}:{self._listener.getsockname()[1]}")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._links: set[ControlLink] = set()
        self._served: set[int] = set()  # pair indices that connected: each is served once
        self._threads: list[threading.Thread] = []
        self._cuda = False
        self._accepter = start_io_thread(cfg.io_cpus, self._accept, "kv-torch-accept")
        self.book.start(cfg)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)
        self._cuda = kv_caches[0][0].is_cuda

    def close(self) -> None:
        self._stop.set()
        close_socket(self._listener)
        with self._lock:
            links, threads = list(self._links), [self._accepter, *self._threads]
        for link in links:
            link.close()
        join_all(threads, self.config.close_timeout_s)
        self.book.stop(self.config.close_timeout_s / 4)
        self._store = None  # the last reference to the master: its server shuts down

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            link = ControlLink(sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                self._links.add(link)
                t = start_io_thread(self.config.io_cpus, self._serve, f"kv-torch-pair-{link.peer}", link)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, link: ControlLink) -> None:
        """One sender: its first message names the pair it claimed in the store; then its layers, in order."""
        cfg = self.config
        pair: _InPair | None = None
        reason = "sender gone"
        try:
            first = link.get(self._stop)
            (index,) = PAIR_INDEX.unpack(first) if len(first) == PAIR_INDEX.size else (-1,)
            with self._lock:
                if not 0 <= index < int(self._store.add(PAIRS_KEY, 0)) or index in self._served:
                    raise ValueError(f"{link.peer} named no pair it claimed, or one already connected "
                                     f"({first[:16]!r})")
                self._served.add(index)
            pair = _InPair(index, link)
            # The group gets a store client of its own: TCPStore clients are not safe for concurrent use.
            group_store = PrefixStore(f"tandem/pair/{index}", store_client(self.endpoint, cfg.connect_timeout_s))
            group = make_group(group_store, 0, self._cuda, cfg.connect_timeout_s, cfg.io_cpus)
            while not self._stop.is_set():
                data: list[Frame] = []  # a run of DATA headers: their recvs are posted together
                for frame, payload in split_frames(link.get(self._stop)):
                    if frame.kind == Kind.DATA:
                        data.append(frame)
                        continue
                    if data:
                        self._data(pair, group, data)
                        data = []
                    self._dispatch(pair, frame, payload)
                if data:
                    self._data(pair, group, data)
            reason = "receiver closed"
        except InterruptedError:
            reason = "receiver closed"
        except Exception as e:  # PeerClosed (a killed sender's kernel closes its socket), gloo errors, bad frames
            reason = f"sender connection lost (peer closed or killed): {e}".splitlines()[0]
        finally:
            link.close()
            with self._lock:
                self._links.discard(link)
            if pair is not None:
                pair.alive = False
                for entry in self.book.entries():
                    if pair in entry.ctx.peers:
                        self.book.fail(entry, f"receiver: {reason} (pair {pair.index})")

    def _dispatch(self, pair: _InPair, frame: Frame, payload: bytes) -> None:
        entry = self.landing.live(frame.transfer_id)
        if entry is None:
            if frame.kind == Kind.HELLO:
                with contextlib.suppress(OSError):
                    pair.link.put_nowait(control(Kind.FAIL, frame.transfer_id,
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
                    with contextlib.suppress(OSError):
                        peer.link.put_nowait(control(Kind.ACK, frame.transfer_id))

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for peer in list(entry.ctx.peers):
            if peer.alive:
                with contextlib.suppress(OSError):
                    peer.link.put_nowait(control(Kind.FAIL, entry.ctx.transfer_id, message.encode()))
