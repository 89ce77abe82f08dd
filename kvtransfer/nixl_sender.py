"""NIXL sender: adds the decode agent, posts one WRITE per layer from its progress thread, completes on ACK.
Design: :mod:`kvtransfer.nixl_backend`.

Every layer's WRITE of a leg is prepared once, when the leg posts its first layer (two prepared descriptor lists
and one ``make_prepped_xfer`` per layer), so that posting a later layer is a single ``transfer`` call. ``transfer``
releases the GIL and has to win it back (measured against a busy Python thread: 6-9 ms of wall time for ~1 ms of
work), so the last layer, whose post is on the critical path, makes one call instead of four.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kvtransfer.base import DestinationInfo, KVCaches, KVSender, OnFailed, TransferState, TransferStatus
from kvtransfer.book import Entry, TransferBook
from kvtransfer.config import TransferConfig
from kvtransfer.doorbell import Ringer, split_endpoint
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.layout import KVLayout
from kvtransfer.nixl_agent import data_notif, hello_payload, make_agent, mem_of, piece_offsets
from kvtransfer.outgoing import Leg, Outbound
from kvtransfer.pacing import Backoff
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, control, unpack

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _LegPlan:
    remote: str
    src_off: np.ndarray
    dst_off: np.ndarray
    lens: np.ndarray
    nbytes: int  # per layer, K and V
    dlists: tuple[Any, Any] | None = None  # prepared (local, remote) descriptor lists covering every layer
    handles: list[Any] = field(default_factory=list)  # per layer: its prepared WRITE, None once taken to post
    pending: list[tuple[int, Any]] = field(default_factory=list)  # (layer, xfer handle)
    waiting: list[tuple[int, Any, float]] = field(default_factory=list)  # (layer, CUDA event, handed at) to post
    hello_at: float = 0.0  # monotonic, when this leg's HELLO went out
    finish_sent: bool = False
    bell: tuple[str, int] | None = None  # the receiver's doorbell (its endpoint), rung when the last layer is written


def _data_header(leg: Leg, layer: int) -> bytes:
    """The frame header of ``layer``'s DATA notification on ``leg`` (its K and V bytes, all runs)."""
    return Frame(Kind.DATA, leg.dest.transfer_id, layer=layer, payload_len=leg.peer.nbytes).pack()


class NixlSender(KVSender):
    backend_name: ClassVar[str] = "nixl"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self.book = TransferBook("sender", on_failed, self._notify_peer)
        self.out = Outbound(self.book, self.backend_name)
        self._agent = make_agent(self.config, "prefill")
        self._agent_lock = threading.Lock()
        self._reg: Any = None
        self._metadata = b""
        self._hello = b""
        self._known: set[str] = set()
        self._ringer = Ringer()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = start_io_thread(self.config.io_cpus, self._progress, "kv-nixl-progress")
        self.book.start(self.config)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.out.register(kv_caches, layout)
        tensors = [t for pair in kv_caches for t in pair]
        with self._agent_lock:
            self._reg = self._agent.register_memory(tensors)
            self._metadata = self._agent.get_agent_metadata()
        self._hello = hello_payload(layout, self._agent.name, self._metadata)  # the same for every request
        self._bases = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        self._mem = mem_of(tensors[0])

    def start(
        self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
        deadline_s: float,
    ) -> None:
        entry = self.out.open(request_id, dest, src_block_ids, deadline_s)
        for leg in entry.ctx.legs:
            d = leg.dest
            try:
                if d.agent_name not in self._known:
                    with self._agent_lock:
                        name = self._agent.add_remote_agent(d.agent_metadata)
                    name = name.decode() if isinstance(name, bytes) else str(name)
                    if name != d.agent_name:
                        raise ValueError(f"agent metadata names {name!r}, destination says {d.agent_name!r}")
                    self._known.add(name)
            except Exception as e:
                self.book.fail(entry, f"sender: cannot add NIXL agent {d.agent_name}: {e}")
                return
            leg.peer = _LegPlan(d.agent_name, np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.uint64), 0,
                                bell=split_endpoint(d.endpoint))
        self.out.plan(entry)  # raises CompatibilityError after notifying the receiver(s)
        hello, layout = self._hello, self.out.layout
        assert layout is not None  # plan() refuses an unregistered sender
        for leg in entry.ctx.legs:
            lp: _LegPlan = leg.peer
            lp.src_off, lp.dst_off, lp.lens = piece_offsets(leg.pieces, layout, leg.dest.layout)
            lp.nbytes = 2 * int(lp.lens.sum())
            try:
                lp.hello_at = time.monotonic()
                with self._agent_lock:
                    self._agent.send_notif(lp.remote, control(Kind.HELLO, leg.dest.transfer_id, hello))
            except Exception as e:
                self.book.fail(entry, f"sender: HELLO to {lp.remote} failed: {e}")
                return

    def send_layer(self, request_id: str, layer: int) -> None:
        entry = self.book.get(request_id)
        if entry.state >= TransferState.DONE:
            return
        handed = time.monotonic()  # this layer's compute is done: the pace the receiver predicts from
        ready = None
        if self._mem[0] == "VRAM":  # pragma: no cover - needs a GPU
            ready = torch.cuda.Event()
            ready.record()
        elif layer == len(self._bases) - 1 and self._post_last_now(entry, layer, handed):
            return
        with self.book.lock:
            for leg in entry.ctx.legs:
                leg.peer.waiting.append((layer, ready, handed))
        self._wake.set()  # the progress thread posts it now (UCX may copy DRAM inside the post call)

    def _post_last_now(self, entry: Entry, layer: int, handed: float) -> bool:
        """Post the last layer of a DRAM transfer on the calling (forward) thread; False to leave it to the progress
        thread (a leg not prepared yet, e.g. a one-layer model, whose preparation that thread owns).

        Nothing computes after the last layer except the logits, and over shared memory UCX copies inside the
        post anyway, so posting here takes the progress thread's wake-up (0.1-0.6 ms measured on 2 vCPUs) off
        the request's critical path. The WRITE's completion is checked here as well, because NIXL sends the
        layer's DATA notification only when a state check finds it complete.
        """
        with self.book.lock:
            if any(leg.peer is None or leg.peer.dlists is None for leg in entry.ctx.legs):
                return False
        for leg in entry.ctx.legs:
            self._post(entry, leg, layer, handed)
            if entry.state >= TransferState.DONE:
                return True
            self._check_pending(entry, leg, only_layer=layer)
        self._wake.set()  # FINISH, and any WRITE still in flight, are the progress thread's
        return True

    def finish(self, request_id: str) -> None:
        entry = self.book.get(request_id)
        with self.book.lock:
            entry.ctx.finish_requested = True
        self._wake.set()  # FINISH goes out, and the ACK is polled for, from now on without backing off

    def poll(self, request_id: str) -> TransferStatus:
        return self.book.status(request_id)

    def release(self, request_id: str) -> None:
        entry = self.book.find(request_id)
        if entry is None:
            return
        self.book.fail(entry, "sender: released before completion", notify_peer=True, tell_owner=False)
        self._drain(entry)
        self.book.pop(request_id)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(self.config.close_timeout_s * 0.6)
        self.book.stop(self.config.close_timeout_s * 0.2)
        for entry in self.book.entries():
            self._drain(entry)
        self._ringer.close()
        with self._agent_lock:
            if self._reg is not None:
                try:
                    self._agent.deregister_memory(self._reg)
                except Exception as e:
                    log.debug("nixl sender: deregister failed: %s", e)
                self._reg = None

    # ---- posting and progress
    def _prepare(self, leg: Leg) -> None:
        """Prepare every layer's WRITE of ``leg``: layer ``i`` is rows ``[i * 2n, (i + 1) * 2n)`` (K runs, V runs)."""
        lp: _LegPlan = leg.peer
        n, layers = len(lp.lens), len(self._bases)
        local = np.empty((layers * 2 * n, 3), dtype=np.uint64)
        remote = np.empty_like(local)
        for layer, (src_bases, dst_bases) in enumerate(zip(self._bases, leg.dest.regions, strict=True)):
            for kv in (0, 1):
                at = (2 * layer + kv) * n
                local[at : at + n, 0] = lp.src_off + np.uint64(src_bases[kv])
                remote[at : at + n, 0] = lp.dst_off + np.uint64(dst_bases[kv])
        local[:, 1] = remote[:, 1] = np.tile(lp.lens, 2 * layers)
        local[:, 2], remote[:, 2] = self._mem[1], leg.dest.device_id
        with self._agent_lock:
            src = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self._mem[0])
            dst = self._agent.prep_xfer_dlist(lp.remote, remote, leg.dest.mem_type)
        with self.book.lock:
            lp.dlists = (src, dst)
        handles = [self._make_write(leg, layer) for layer in range(layers)]
        with self.book.lock:
            lp.handles = handles

    def _make_write(self, leg: Leg, layer: int) -> Any:
        lp: _LegPlan = leg.peer
        if lp.dlists is None:
            raise RuntimeError("the leg was released")
        n = 2 * len(lp.lens)
        rows = np.arange(layer * n, (layer + 1) * n, dtype=np.int32)
        notif = _data_header(leg, layer)
        with self._agent_lock:
            return self._agent.make_prepped_xfer("WRITE", lp.dlists[0], rows, lp.dlists[1], rows, notif)

    def _take_write(self, leg: Leg, layer: int) -> Any:
        lp: _LegPlan = leg.peer
        if lp.dlists is None:
            self._prepare(leg)
        with self.book.lock:
            handle = lp.handles[layer] if layer < len(lp.handles) else None
            if handle is not None:
                lp.handles[layer] = None
        return handle if handle is not None else self._make_write(leg, layer)  # a layer sent twice: a fresh one

    def _post(self, entry: Entry, leg: Leg, layer: int, handed: float) -> None:
        """Post ``layer``'s WRITE; its DATA notification carries when the layer was handed over (see
        :func:`kvtransfer.nixl_agent.data_notif`), so the receiver can predict the last layer from the compute's
        pace rather than from notifications that this thread may have posted late."""
        lp: _LegPlan = leg.peer
        if entry.state >= TransferState.DONE:
            return
        try:
            handle = self._take_write(leg, layer)
            notif = data_notif(_data_header(leg, layer), handed - lp.hello_at)
            with self._agent_lock:
                state = self._agent.transfer(handle, notif)
        except Exception as e:
            self.book.fail(entry, f"sender: posting layer {layer} to {lp.remote} failed: {e}", notify_peer=True)
            return
        if state == "ERR":
            self.book.fail(entry, f"sender: NIXL refused layer {layer} to {lp.remote}", notify_peer=True)
            with self._agent_lock:
                handle.release()
            return
        with self.book.lock:
            lp.pending.append((layer, handle))

    def _drain(self, entry: Entry) -> None:
        for leg in entry.ctx.legs:
            lp: _LegPlan | None = leg.peer
            if lp is None:
                continue
            with self.book.lock:
                pending, lp.pending, lp.waiting = lp.pending, [], []
                unposted, lp.handles = [h for h in lp.handles if h is not None], []
                dlists, lp.dlists = lp.dlists, None
            for handle in [h for _, h in pending] + unposted:
                try:
                    with self._agent_lock:
                        handle.release()
                except Exception as e:  # an in-flight handle may refuse; NIXL frees it with the agent
                    log.debug("nixl sender: release of in-flight handle failed: %s", e)
            for dlist in dlists or ():
                try:
                    with self._agent_lock:
                        dlist.release()
                except Exception as e:
                    log.debug("nixl sender: release of a prepared descriptor list failed: %s", e)

    def _progress(self) -> None:
        pace = Backoff(self.config.poll_interval_s)
        while not self._stop.is_set():
            if self._wake.wait(pace.next_timeout()):
                self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._tick():
                    pace.reset()
            except Exception:
                log.exception("nixl sender: progress tick failed")

    def _tick(self) -> bool:
        """One progress pass; True while polling must stay fast (see :meth:`_urgent`)."""
        busy = False
        for entry in self.book.entries():
            if entry.state >= TransferState.DONE:
                if entry.state == TransferState.FAILED:
                    self._drain(entry)
                continue
            for leg in entry.ctx.legs:
                self._advance(entry, leg)
                busy = busy or self._urgent(entry, leg)
        with self._agent_lock:
            notifs = self._agent.get_new_notifs()
        for remote, msgs in notifs.items():
            for msg in msgs:
                self._on_notif(remote, bytes(msg))
        return busy or bool(notifs)

    @staticmethod
    def _urgent(entry: Entry, leg: Leg) -> bool:
        """Whether ``leg`` waits on something this thread must notice at once: a layer not yet posted, a WRITE in
        flight (NIXL sends its DATA notification only once a state check finds it complete) or, once every layer
        was given, the ACK.

        Between two layers of a long prefill a leg has nothing in flight; the thread then backs off to
        ``poll_interval_s`` (``send_layer`` still wakes it at once) instead of taking the GIL from the forward pass
        every few tens of microseconds.
        """
        lp: _LegPlan | None = leg.peer
        return lp is not None and bool(lp.pending or lp.waiting or (entry.ctx.finish_requested and not leg.acked))

    def _advance(self, entry: Entry, leg: Leg) -> None:
        lp: _LegPlan | None = leg.peer
        if lp is None:
            return
        for layer, ev, handed in list(lp.waiting):
            if ev is None or ev.query():
                with self.book.lock:
                    lp.waiting.remove((layer, ev, handed))
                self._post(entry, leg, layer, handed)
                if entry.state >= TransferState.DONE:
                    return
        if not self._check_pending(entry, leg):
            return
        num_layers = len(self._bases)
        if entry.ctx.finish_requested and not lp.finish_sent and leg.layers_sent >= num_layers:
            lp.finish_sent = True
            try:
                with self._agent_lock:
                    self._agent.send_notif(lp.remote, control(Kind.FINISH, leg.dest.transfer_id))
            except Exception as e:
                self.book.fail(entry, f"sender: FINISH to {lp.remote} failed: {e}")

    def _check_pending(self, entry: Entry, leg: Leg, only_layer: int | None = None) -> bool:
        """Collect ``leg``'s completed WRITEs (only ``only_layer``'s when given); False if one failed.

        Called from the progress thread and, for the last layer, from the posting thread: a handle is taken off
        ``pending`` under the book's lock before it is released, so each is released exactly once.
        """
        lp: _LegPlan = leg.peer
        with self.book.lock:
            candidates = [p for p in lp.pending if only_layer is None or p[0] == only_layer]
        for layer, handle in candidates:
            with self._agent_lock:  # held from the membership check to the release: no other thread can free it
                with self.book.lock:
                    if (layer, handle) not in lp.pending:
                        continue  # collected by the other thread, or taken by _drain, which releases it
                state = self._agent.check_xfer_state(handle)
                if state == "PROC":
                    continue
                with self.book.lock:
                    if (layer, handle) not in lp.pending:
                        continue
                    lp.pending.remove((layer, handle))
                handle.release()
            if state == "ERR":
                self.book.fail(entry, f"sender: NIXL WRITE of layer {layer} to {lp.remote} failed "
                               "(receiver unreachable or gone)", notify_peer=True)
                return False
            self.out.leg_sent_layer(entry, leg, lp.nbytes)
            if leg.layers_sent == len(self._bases):  # its DATA notification went out with this state check
                self._ringer.ring(lp.bell)
        return True

    def _on_notif(self, remote: str, msg: bytes) -> None:
        frame = unpack(msg)
        for entry in self.book.entries():
            for leg in entry.ctx.legs:
                if leg.dest.transfer_id != frame.transfer_id or leg.dest.agent_name != remote:
                    continue
                if frame.kind == Kind.ACK:
                    self.out.leg_acked(entry, leg)
                elif frame.kind == Kind.FAIL:
                    text = msg[HEADER_SIZE : HEADER_SIZE + frame.payload_len].decode(errors="replace")
                    self.book.fail(entry, f"sender: receiver reported: {text}")
                return

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                with self._agent_lock:
                    self._agent.send_notif(leg.peer.remote, control(Kind.FAIL, leg.dest.transfer_id, message.encode()))
                self._ringer.ring(leg.peer.bell)  # the receiver frees its blocks now, not at its next tick
