"""NIXL backend: one-sided WRITE from prefill into decode's reserved blocks, one transfer per layer.

WRITE, layer by layer, because prefill knows when a layer is ready: each layer is pushed as soon as it is computed
and decode's CPU never moves a byte, it only watches notifications. Every layer's WRITE is prepared when the first
is posted, so a later layer costs one ``transfer`` call; the last layer of a DRAM transfer is posted by the forward
thread itself (it is on the critical path). The receiver counts landed bytes from the DATA notifications NIXL sends
after each WRITE, answers ACK when every layer landed, and polls on a schedule predicted from the prefill's layer
pace, woken early by a UDP doorbell the sender rings (a hint only). A HELLO for a reservation that is gone is
answered with FAIL, so the sender frees its blocks at once. UCX settings: :func:`kvtransfer.nixl_agent.ucx_environment`.

No WRITE lands in blocks decode gave to another request. The receiver's threads never move a byte, so releasing a
reservation cannot wait for a write in progress, as the tcp and torch receivers do. Instead, per leg::

    sender:   HELLO ─► (READY) ─► WRITE × L ─► FINISH ─► (ACK) DONE
              FAILED or released, at any point ─► no post from then on ─► every posted WRITE DONE or ERR ─► QUIET
    receiver: HELLO of a live reservation ─► the peer is *accepted* ─► READY
              released before DONE ─► held (release returns True) until every accepted peer sent QUIET ─► quiet()

A sender posts nothing before its leg's READY, nor after its lease deadline, so a reservation released before it
accepted any HELLO has no writer and is freed at once (a later HELLO gets FAIL, never READY). The round trip is
hidden behind preparing the leg's descriptors and the first layer's compute. An accepted peer that never sends QUIET
(killed, partitioned) holds the blocks until the lease deadline plus ``QUARANTINE_GRACE_S``. That assumes a dead
process cannot write: its WRITEs in flight end with it (UCX over TCP or shared memory: the receiver's UCX finishes
within the grace what already reached its socket; RDMA: the kernel tears down the dead process's queue pairs, and a
WRITE of a destroyed queue pair is not executed), and that the two hosts' clocks agree to well within the grace
(the sender stops posting at its own deadline, which is at most the receiver's lease, in wall-clock time).
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

from kvtransfer.base import DestinationInfo, KVCaches, KVSender, TransferState
from kvtransfer.book import Entry, OnFailed
from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import start_io_thread
from kvtransfer.landing import LandingReceiver, Reservation
from kvtransfer.layout import KVLayout
from kvtransfer.nixl_agent import Agent, Backoff, Doorbell, Ringer, data_notif, handed_after, split_endpoint
from kvtransfer.outgoing import Leg, Outbound
from kvtransfer.plan import Piece
from kvtransfer.wire import HEADER_SIZE, Frame, Kind, control, hello_payload, parse_hello, unpack

log = logging.getLogger(__name__)
ACTIVE_POLL_S = 2.5e-4
IDLE_POLL_S = 0.5
HELLO_WINDOW_S = 0.002
RING_WINDOW_S = 0.005  # how long a doorbell ring that found no notification keeps the watcher polling fast
MAX_SLEEP_S = 0.02  # the longest sleep while some reservation has layers due
# Where the last layer may land, around its predicted time, in layer times: polled every ACTIVE_POLL_S. One
# prefill's layer times spread around their mean (other processes, memory bandwidth), hence the margins.
DUE_EARLY, DUE_LATE = 0.3, 0.6
# A released reservation whose accepted senders did not all send QUIET is held this long past its lease deadline: a
# sender past its deadline posts nothing, so only WRITEs of a dead or partitioned one can be left (module docstring).
QUARANTINE_GRACE_S = 1.0


@dataclass(slots=True)
class _LegPlan:
    remote: str
    bell: tuple[str, int] | None  # the receiver's doorbell (its endpoint), rung when the last layer is written
    nbytes: int = 0  # per layer, K and V
    descs: int = 0  # descriptors per layer, K and V
    dlists: tuple[Any, Any] | None = None  # prepared (local, remote) descriptor lists covering every layer
    handles: list[Any] = field(default_factory=list)  # per layer: its prepared WRITE, None once taken to post
    pending: list[tuple[int, Any]] = field(default_factory=list)  # (layer, xfer handle)
    waiting: list[tuple[int, Any, float]] = field(default_factory=list)  # (layer, CUDA event, handed at) to post
    hello_at: float = 0.0  # monotonic, when this leg's HELLO went out (0: it did not)
    finish_sent: bool = False
    ready: bool = False  # the receiver accepted our HELLO: WRITEs may be posted from now on, never before
    quiet: bool = False  # failed or released: every posted WRITE reached a final state, handles freed, QUIET sent


def piece_offsets(pieces: Sequence[Piece], src: KVLayout, dst: KVLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets (from a layer tensor's base) and lengths of every descriptor of one layer's K (or V): one per
    piece when the pieces carry every local head on both ends, else one per token row of each piece."""
    if all(p.src_heads[1] - p.src_heads[0] == src.local_heads == dst.local_heads for p in pieces):
        table = np.array([(p.src_start, p.dst_start, p.nbytes) for p in pieces], dtype=np.uint64).reshape(-1, 3)
        return table[:, 0] * np.uint64(src.block_bytes), table[:, 1] * np.uint64(dst.block_bytes), table[:, 2].copy()
    head_bytes = src.head_dim * src.element_size
    cols: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for p in pieces:
        rows = np.arange(p.num_blocks * src.block_size, dtype=np.uint64)
        cols[0].append((p.src_start * src.block_size + rows) * src.token_bytes + p.src_heads[0] * head_bytes)
        cols[1].append((p.dst_start * dst.block_size + rows) * dst.token_bytes + p.dst_heads[0] * head_bytes)
        cols[2].append(np.full(rows.shape, (p.src_heads[1] - p.src_heads[0]) * head_bytes, dtype=np.uint64))
    return np.concatenate(cols[0]), np.concatenate(cols[1]), np.concatenate(cols[2])


def _data_header(leg: Leg, layer: int) -> bytes:
    """The frame header of ``layer``'s DATA notification on ``leg`` (its K and V bytes, all runs)."""
    return Frame(Kind.DATA, leg.dest.transfer_id, layer=layer, payload_len=leg.peer.nbytes).pack()


class NixlSender(KVSender):
    """Adds the decode agent, posts one WRITE per layer from its progress thread, completes on ACK."""

    backend_name: ClassVar[str] = "nixl"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self.out = Outbound(self.book, self.backend_name)
        self._agent = Agent(self.config, "prefill")
        self._hello = b""
        self._ringer = Ringer()
        self._stop = threading.Event()
        self._wake = threading.Event()
        # Taken around "may this leg post?" and the post itself, and by _quiesce: once a leg is quiet no post can
        # follow. Lock order: _post_lock, then the agent's lock, then the book's.
        self._post_lock = threading.RLock()
        self._quiescing: list[Entry] = []  # released entries whose legs are not quiet yet (under the book's lock)
        self._thread = start_io_thread(self.config.io_cpus, self._progress, "kv-nixl-progress")
        self.book.start(self.config)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.out.register(kv_caches, layout)
        self._agent.register(kv_caches)
        self._hello = hello_payload(layout, self._agent.name, self._agent.metadata)  # the same for every request

    def start(self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
              deadline_s: float) -> None:
        entry = self.out.open(request_id, dest, src_block_ids, deadline_s)
        for leg in entry.ctx.legs:
            d = leg.dest
            try:
                if d.agent_name not in self._agent.known:
                    name = self._agent.add_remote(d.agent_metadata)
                    if name != d.agent_name:
                        raise ValueError(f"agent metadata names {name!r}, destination says {d.agent_name!r}")
            except Exception as e:
                self.book.fail(entry, f"sender: cannot add NIXL agent {d.agent_name}: {e}")
                return
            leg.peer = _LegPlan(d.agent_name, split_endpoint(d.endpoint))
        self.out.plan(entry)  # raises CompatibilityError after notifying the receiver(s)
        for leg in entry.ctx.legs:
            lp: _LegPlan = leg.peer
            lp.nbytes = 2 * sum(p.nbytes for p in leg.pieces)
            try:
                lp.hello_at = time.monotonic()
                self._agent.send(lp.remote, control(Kind.HELLO, leg.dest.transfer_id, self._hello))
            except Exception as e:
                self.book.fail(entry, f"sender: HELLO to {lp.remote} failed: {e}")
                return
            self._ringer.ring(lp.bell)  # the receiver answers READY now, not at its next tick
        self._wake.set()  # the progress thread prepares the legs' WRITEs while READY is on its way

    def send_layer(self, request_id: str, layer: int) -> None:
        entry = self.book.get(request_id)
        if entry.state >= TransferState.DONE:
            return
        handed = time.monotonic()  # this layer's compute is done: the pace the receiver predicts from
        ready = None
        if self._agent.mem[0] == "VRAM":  # pragma: no cover - needs a GPU
            ready = torch.cuda.Event()
            ready.record()
        elif layer == len(self._agent.bases) - 1 and self._post_last_now(entry, layer, handed):
            return
        with self.book.lock:
            for leg in entry.ctx.legs:
                leg.peer.waiting.append((layer, ready, handed))
        self._wake.set()  # the progress thread posts it now (UCX may copy DRAM inside the post call)

    def _post_last_now(self, entry: Entry, layer: int, handed: float) -> bool:
        """Post the last layer of a DRAM transfer on the forward thread (it is on the critical path), and check its
        completion here too (NIXL sends the DATA notification only then); False to leave it to the progress thread
        (a leg not prepared yet)."""
        with self.book.lock:
            if any(leg.peer is None or leg.peer.dlists is None or not leg.peer.ready for leg in entry.ctx.legs):
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

    def release(self, request_id: str) -> None:
        entry = self.out.release(request_id)
        if entry is None:
            return
        if entry.state == TransferState.DONE:  # acknowledged: every WRITE completed before its DATA notification
            self._drain(entry)
            return
        with self.book.lock:  # FAILED: the progress thread waits out its posted WRITEs, then sends QUIET
            self._quiescing.append(entry)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(self.config.close_timeout_s * 0.6)
        self.book.stop(self.config.close_timeout_s * 0.2)
        with self.book.lock:
            left, self._quiescing = self.book.entries() + self._quiescing, []
        for entry in left:
            if entry.state != TransferState.DONE:
                self.book.fail(entry, "sender: closed before completion")
                self._quiesce(entry)  # QUIET for the legs whose WRITEs are over; the others' receivers wait out
            self._drain(entry)
        self._ringer.close()
        self._agent.close()

    def _prepare(self, leg: Leg) -> None:
        """Prepare every layer's WRITE of ``leg``: layer ``i`` is rows ``[i * 2n, (i + 1) * 2n)`` (K runs, V runs)."""
        lp: _LegPlan = leg.peer
        assert self.out.layout is not None  # start() refuses an unregistered sender
        src_off, dst_off, lens = piece_offsets(leg.pieces, self.out.layout, leg.dest.layout)
        n, layers = len(lens), len(self._agent.bases)
        local = np.empty((layers * 2 * n, 3), dtype=np.uint64)
        remote = np.empty_like(local)
        for layer, (src_bases, dst_bases) in enumerate(zip(self._agent.bases, leg.dest.regions, strict=True)):
            for kv in (0, 1):
                at = (2 * layer + kv) * n
                local[at : at + n, 0] = src_off + np.uint64(src_bases[kv])
                remote[at : at + n, 0] = dst_off + np.uint64(dst_bases[kv])
        local[:, 1] = remote[:, 1] = np.tile(lens, 2 * layers)
        local[:, 2], remote[:, 2] = self._agent.mem[1], leg.dest.device_id
        with self._agent.lock:
            src = self._agent.nixl.prep_xfer_dlist("NIXL_INIT_AGENT", local, self._agent.mem[0])
            dst = self._agent.nixl.prep_xfer_dlist(lp.remote, remote, leg.dest.mem_type)
        with self.book.lock:
            lp.dlists, lp.descs = (src, dst), 2 * n
        handles = [self._make_write(leg, layer) for layer in range(layers)]
        with self.book.lock:
            lp.handles = handles

    def _make_write(self, leg: Leg, layer: int) -> Any:
        lp: _LegPlan = leg.peer
        if lp.dlists is None:
            raise RuntimeError("the leg was released")
        rows = np.arange(layer * lp.descs, (layer + 1) * lp.descs, dtype=np.int32)
        with self._agent.lock:
            return self._agent.nixl.make_prepped_xfer("WRITE", lp.dlists[0], rows, lp.dlists[1], rows,
                                                       _data_header(leg, layer))

    def _post(self, entry: Entry, leg: Leg, layer: int, handed: float) -> None:
        """Post ``layer``'s WRITE; its DATA notification carries when the layer was handed over (see
        :func:`kvtransfer.nixl_agent.data_notif`), so the receiver can predict the last layer from the compute's
        pace rather than from notifications that this thread may have posted late."""
        lp: _LegPlan = leg.peer
        with self._post_lock:  # _quiesce cannot declare the leg quiet between this check and the post
            if entry.state >= TransferState.DONE or lp.quiet:
                return
            if time.monotonic() >= entry.deadline:  # the receiver's lease may be over: its blocks may be reused
                self.book.fail(entry, f"sender: lease expired before layer {layer} was posted to {lp.remote}",
                               notify_peer=True)
                return
            try:
                if lp.dlists is None:
                    self._prepare(leg)
                with self.book.lock:  # each prepared WRITE is posted once: a layer sent twice gets a fresh one
                    handle = lp.handles[layer] if layer < len(lp.handles) else None
                    if handle is not None:
                        lp.handles[layer] = None
                handle = handle if handle is not None else self._make_write(leg, layer)
                notif = data_notif(_data_header(leg, layer), handed - lp.hello_at)
                with self._agent.lock:
                    state = self._agent.nixl.transfer(handle, notif)
            except Exception as e:
                self.book.fail(entry, f"sender: posting layer {layer} to {lp.remote} failed: {e}", notify_peer=True)
                return
            if state == "ERR":
                self.book.fail(entry, f"sender: NIXL refused layer {layer} to {lp.remote}", notify_peer=True)
                self._agent.release(handle)
                return
            with self.book.lock:
                lp.pending.append((layer, handle))

    def _drain(self, entry: Entry) -> None:
        """Release every handle of ``entry`` now, posted or not (DONE, or closing)."""
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                self._drain_leg(leg.peer)

    def _drain_leg(self, lp: _LegPlan) -> None:
        with self.book.lock:
            pending, lp.pending, lp.waiting = lp.pending, [], []
            unposted, lp.handles = [h for h in lp.handles if h is not None], []
            dlists, lp.dlists = lp.dlists, None
        for handle in [h for _, h in pending] + unposted + list(dlists or ()):
            self._agent.release(handle)

    def _quiesce(self, entry: Entry) -> bool:
        """A FAILED or released ``entry``: for each leg whose posted WRITEs all reached a final state (DONE or ERR),
        release its handles and tell its receiver QUIET (it never writes there again); True once every leg is
        quiet. A WRITE still in progress past the lease deadline plus ``QUARANTINE_GRACE_S`` is released anyway:
        the receiver stopped waiting for it by then. Never blocks: the progress thread calls it again."""
        if all(leg.peer is None or leg.peer.quiet for leg in entry.ctx.legs):
            return True  # the common case on later ticks: no lock taken
        all_quiet = True
        with self._post_lock:  # no post between the last check below and QUIET
            for leg in entry.ctx.legs:
                lp: _LegPlan | None = leg.peer
                if lp is None or lp.quiet:
                    continue
                with self.book.lock:
                    lp.waiting = []  # handed over, never posted: dropped
                    candidates = list(lp.pending)
                overdue = time.monotonic() >= entry.deadline + QUARANTINE_GRACE_S
                for layer, handle in candidates:
                    with self._agent.lock:
                        with self.book.lock:
                            if (layer, handle) not in lp.pending:
                                continue  # collected by _check_pending on the forward thread
                        try:
                            state = self._agent.nixl.check_xfer_state(handle)
                        except Exception:
                            state = "ERR"
                        if state == "PROC" and not overdue:
                            continue
                        with self.book.lock:
                            lp.pending.remove((layer, handle))
                        try:
                            handle.release()
                        except Exception as e:  # an in-flight handle may refuse; NIXL frees it with the agent
                            log.debug("nixl: release of a WRITE of layer %d failed: %s", layer, e)
                with self.book.lock:
                    still = bool(lp.pending)
                if still:
                    all_quiet = False
                    continue
                self._drain_leg(lp)
                lp.quiet = True
                if lp.hello_at:  # the receiver may have accepted our HELLO: it holds the blocks until QUIET
                    try:
                        self._agent.send(lp.remote, control(Kind.QUIET, leg.dest.transfer_id))
                        self._ringer.ring(lp.bell)
                    except Exception as e:  # the receiver's hold then ends at its lease deadline plus the grace
                        log.debug("nixl sender: QUIET to %s failed: %s", lp.remote, e)
        return all_quiet

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
        """One progress pass; True while polling must stay fast: a leg waits on something to notice at once (a layer
        to post, a WRITE in flight, the ACK). Otherwise the thread backs off between layers instead of taking the GIL
        from the forward pass."""
        busy = False
        for entry in self.book.entries():
            if entry.state >= TransferState.DONE:
                if entry.state == TransferState.FAILED:
                    busy = not self._quiesce(entry) or busy
                continue
            for leg in entry.ctx.legs:
                self._advance(entry, leg)
                lp: _LegPlan | None = leg.peer
                busy = busy or (lp is not None and bool(lp.pending or lp.waiting or (lp.hello_at and not lp.ready) or
                                                       (entry.ctx.finish_requested and not leg.acked)))
        with self.book.lock:
            quiescing = list(self._quiescing)
        for entry in quiescing:
            if self._quiesce(entry):
                with self.book.lock:
                    self._quiescing.remove(entry)
            else:
                busy = True
        notifs = self._agent.get_new_notifs()
        for remote, msgs in notifs.items():  # READY, ACK and FAIL, for the leg of that transfer id on that agent
            for msg in map(bytes, msgs):
                frame = unpack(msg)
                for entry in self.book.entries():
                    for leg in entry.ctx.legs:
                        if leg.dest.transfer_id != frame.transfer_id or leg.dest.agent_name != remote:
                            continue
                        if frame.kind == Kind.READY:
                            if leg.peer is not None:
                                with self.book.lock:
                                    leg.peer.ready = True
                                self._advance(entry, leg)  # post the layers already handed over, now
                        else:
                            self.out.on_reply(entry, leg, frame, msg[HEADER_SIZE : HEADER_SIZE + frame.payload_len])
        return busy or bool(notifs)

    def _advance(self, entry: Entry, leg: Leg) -> None:
        lp: _LegPlan | None = leg.peer
        if lp is None:
            return
        if not lp.ready:  # nothing is posted before READY: prepare the WRITEs meanwhile
            # Only once its HELLO is out: until then start() may still be planning the leg's pieces on its thread
            # (a leg prepared from an empty plan failed the transfer, once in CI).
            if lp.dlists is None and lp.hello_at:
                try:
                    self._prepare(leg)
                except Exception as e:
                    self.book.fail(entry, f"sender: preparing the WRITEs to {lp.remote} failed: {e}", notify_peer=True)
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
        num_layers = len(self._agent.bases)
        if entry.ctx.finish_requested and not lp.finish_sent and leg.layers_sent >= num_layers:
            lp.finish_sent = True
            try:
                self._agent.send(lp.remote, control(Kind.FINISH, leg.dest.transfer_id))
            except Exception as e:
                self.book.fail(entry, f"sender: FINISH to {lp.remote} failed: {e}")

    def _check_pending(self, entry: Entry, leg: Leg, only_layer: int | None = None) -> bool:
        """Collect ``leg``'s completed WRITEs (only ``only_layer``'s when given); False if one failed. Two threads
        call it, so a handle leaves ``pending`` under the book's lock before its single release."""
        lp: _LegPlan = leg.peer
        with self.book.lock:
            candidates = [p for p in lp.pending if only_layer is None or p[0] == only_layer]
        for layer, handle in candidates:
            with self._agent.lock:  # held from the membership check to the release: no other thread can free it
                with self.book.lock:
                    if (layer, handle) not in lp.pending:
                        continue  # collected by the other thread, or taken by _drain, which releases it
                state = self._agent.nixl.check_xfer_state(handle)
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
            if leg.layers_sent == len(self._agent.bases):  # its DATA notification went out with this state check
                self._ringer.ring(lp.bell)
        return True

    def _notify_peer(self, entry: Entry, message: str) -> None:
        for leg in entry.ctx.legs:
            if leg.peer is not None:
                self._agent.send(leg.peer.remote, control(Kind.FAIL, leg.dest.transfer_id, message.encode()))
                self._ringer.ring(leg.peer.bell)  # the receiver frees its blocks now, not at its next tick


@dataclass(slots=True)
class _Pace:
    """One transfer's timing, to predict when its last layer lands. Each DATA notification carries when its layer's
    compute ended, as an offset from the leg's HELLO on the sender's clock (no clock sync needed); two give the layer
    time. Offsets, not arrival times, because the progress thread may post earlier layers late."""

    hello_lo: float
    hello_seen: float
    first: tuple[int, float] | None = None  # (layer, offset) of the lowest layer reported
    last: tuple[int, float] | None = None  # (layer, offset) of the highest
    landed_at: float = 0.0  # the watcher's poll time when a layer of this transfer last landed

    def note(self, layer: int, offset: float, now: float) -> None:
        self.landed_at = now
        if self.first is None or layer < self.first[0]:
            self.first = (layer, offset)
        if self.last is None or layer > self.last[0]:
            self.last = (layer, offset)

    def due(self, layers: int) -> tuple[float, float] | None:
        """(when the last layer is due, monotonic; the mean layer time), once two layers were reported."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        lt = max(self.last[1] - self.first[1], 0.0) / (self.last[0] - self.first[0])
        return self.hello_lo + self.last[1] + (layers - 1 - self.last[0]) * lt, lt


@dataclass(slots=True)
class _Held:
    """A reservation released before DONE whose accepted senders may still WRITE into its blocks."""

    request_id: str
    writers: set[str]  # accepted peers (agent names) that have not sent QUIET
    until: float  # monotonic: the lease deadline plus QUARANTINE_GRACE_S, when a silent writer counts as dead


class NixlReceiver(LandingReceiver):
    """Registers the KV tensors, publishes them in the hand-off, and counts landed layers from the senders'
    notifications."""

    backend_name: ClassVar[str] = "nixl"

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self._agent = Agent(self.config, "decode")
        self._bell = Doorbell(self.config.host)  # the senders ring it when a transfer's last layer is written
        self.endpoint = self._bell.endpoint
        self._stop = threading.Event()
        self._reserved = threading.Event()  # set by reserve: the watcher starts polling
        self._pace: dict[int, _Pace] = {}  # transfer id -> timing, from its HELLO on (watcher thread only)
        self._poll_prev = self._poll_now = 0.0  # the watcher's previous and current poll times
        self._held: dict[int, _Held] = {}  # transfer id -> released, still writable (under the book's lock)
        self._quiet: list[str] = []  # held requests that turned quiet, for quiet() (under the book's lock)
        self._thread = start_io_thread(self.config.io_cpus, self._watch, "kv-nixl-notifs")
        self.book.start(self.config)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)
        self._agent.register(kv_caches)

    def _published(self) -> dict[str, Any]:
        a = self._agent
        return {"endpoint": self.endpoint, "agent_name": a.name, "agent_metadata": a.metadata, "regions": a.bases,
                "mem_type": a.mem[0], "device_id": a.mem[1]}

    def reserve(self, request_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                deadline_s: float) -> DestinationInfo:
        dest = super().reserve(request_id, dst_block_ids, num_tokens, deadline_s)
        self._reserved.set()
        return dest

    def release(self, request_id: str) -> bool:
        """Release ``request_id``; True when its blocks must stay held because a sender we sent READY has not sent
        QUIET yet (not for a DONE reservation: every WRITE completed before its DATA notification)."""
        entry = self.book.find(request_id)
        if entry is None:
            return False
        self.book.fail(entry, "receiver: released before completion", notify_peer=True, tell_owner=False)
        with self.book.lock:  # after the fail: no peer is accepted from now on (_accept checks the state)
            res: Reservation = entry.ctx
            writers = set() if entry.state == TransferState.DONE else res.accepted - res.quiet
            self.book.pop(request_id)
            self._by_tid.pop(res.transfer_id, None)
            if writers:
                self._held[res.transfer_id] = _Held(request_id, writers, entry.deadline + QUARANTINE_GRACE_S)
        if writers:
            self._reserved.set()  # the watcher polls for their QUIET
        return bool(writers)

    def quiet(self) -> list[str]:
        with self.book.lock:
            self._end_overdue(time.monotonic())
            out, self._quiet = self._quiet, []
        return out

    def held(self) -> int:
        """Released reservations still held for a writer's QUIET."""
        with self.book.lock:
            return len(self._held)

    def _end_overdue(self, now: float) -> None:
        """Holds past their lease deadline plus the grace end: a writer silent that long is dead (module docstring).
        Under the book's lock."""
        for tid in [tid for tid, h in self._held.items() if now >= h.until]:
            held = self._held.pop(tid)
            log.warning("nixl receiver: %s freed at its lease deadline + %.1fs: no QUIET from %s", held.request_id,
                        QUARANTINE_GRACE_S, sorted(held.writers))
            self._quiet.append(held.request_id)

    def _on_quiet(self, tid: int, remote: str) -> None:
        """``remote`` will never write into transfer ``tid`` again."""
        with self.book.lock:
            held = self._held.get(tid)
            if held is not None:
                held.writers.discard(remote)
                if not held.writers:
                    del self._held[tid]
                    self._quiet.append(held.request_id)
                return
            entry = self._by_tid.get(tid)  # failed (or racing its failure) but not released yet
            if entry is not None:
                entry.ctx.quiet.add(remote)

    def _accept(self, entry: Entry, remote: str) -> None:
        """Admit ``remote``'s WRITEs into a live reservation: recorded before READY goes out, under the lock
        ``release`` takes after failing the entry, so a release either sees the peer or the peer gets no READY."""
        with self.book.lock:
            if entry.state >= TransferState.DONE:
                return
            entry.ctx.accepted.add(remote)
        self._agent.send(remote, control(Kind.READY, entry.ctx.transfer_id))

    def close(self) -> None:
        self._stop.set()
        self._reserved.set()
        self._thread.join(self.config.close_timeout_s * 0.6)
        self.book.stop(self.config.close_timeout_s * 0.2)
        self._bell.close()
        self._agent.close()

    def _send(self, peer: str, data: bytes) -> None:
        self._agent.send(peer, data)

    def _watch(self) -> None:
        """Poll the agent's notifications as rarely as the critical path allows (each wake-up takes decode's CPU and
        GIL); only a transfer's last DATA notification is on that path.

        No reservation: no polling (``reserve`` wakes it). No HELLO yet: every ``poll_interval_s``. Right after a
        HELLO: a doubling tick up to ``ACTIVE_POLL_S``. Then half the time left until the predicted last layer
        (:class:`_Pace`), and ``ACTIVE_POLL_S`` from ``DUE_EARLY`` layer times before it to ``DUE_LATE`` after it or
        while layers keep landing. Every sleep is a ``select`` on the doorbell, which cuts it short (and a ring that
        found nothing yet is followed by polls from 50 us up to ``ACTIVE_POLL_S`` apart for ``RING_WINDOW_S``: its
        notification trails).
        """
        pace = Backoff(self.config.poll_interval_s)
        expect_until = 0.0  # after a ring that found no notification: poll fast until then
        trail = Backoff(ACTIVE_POLL_S)  # that fast poll: from 50 us, doubling up to ACTIVE_POLL_S
        while not self._stop.is_set():
            if not self._in_flight() and not self._held:  # a reserve or release racing this sets _reserved
                self._reserved.wait(IDLE_POLL_S)
                self._reserved.clear()
            # Not an Event wait: a timed Event.wait costs about twice the CPU of a plain sleep or a select. Only a
            # sender's doorbell (a HELLO or QUIET sent, its last layer written) or close() (bounded by MAX_SLEEP_S)
            # cuts the sleep short.
            now = time.monotonic()
            sleep = self._next_sleep(now, pace)
            rung = self._bell.wait(sleep if now >= expect_until else min(sleep, trail.next_timeout()))
            if self._stop.is_set():
                return
            self._poll_prev, self._poll_now = self._poll_now, time.monotonic()
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:
                log.exception("nixl receiver: get_new_notifs failed")
                continue
            if notifs:
                expect_until = 0.0
            elif rung:  # the notification the ring announces may trail the datagram: look again soon
                expect_until = self._poll_now + RING_WINDOW_S
                trail.reset()
            for remote, msgs in notifs.items():
                for msg in msgs:
                    try:
                        if self._handle(remote, bytes(msg)) == Kind.HELLO:
                            pace.reset()
                    except Exception:
                        log.exception("nixl receiver: bad notification from %s", remote)
            for tid in [tid for tid in self._pace if self._live(tid) is None]:
                del self._pace[tid]
            if self._held:
                with self.book.lock:
                    self._end_overdue(time.monotonic())

    def _next_sleep(self, now: float, pace: Backoff) -> float:
        """This tick's sleep, by the rules of :meth:`_watch`."""
        tick, best, window = self.config.poll_interval_s, MAX_SLEEP_S, False
        if self._held:  # a QUIET is due (its sender rings the doorbell too)
            best = tick
        layers = len(self._agent.bases) or 1  # registered layers
        for entry in self._in_flight():  # a snapshot, taken under the book's lock
            p = self._pace.get(entry.ctx.transfer_id)
            if p is None:  # no HELLO yet
                best = min(best, tick)
                continue
            timing = p.due(layers)
            if timing is None and now < p.hello_seen + HELLO_WINDOW_S:
                window = True
                continue
            if timing is None:  # fewer than two layers reported
                cand = ACTIVE_POLL_S if layers - entry.layers_done <= 1 else max((now - p.hello_lo) / 2, tick)
            else:
                due, lt = timing
                opens = due - DUE_EARLY * lt
                if now < opens:
                    cand = max((opens - now) / 2, ACTIVE_POLL_S)
                elif now <= due + DUE_LATE * lt or now - p.landed_at < max(lt, HELLO_WINDOW_S):
                    cand = ACTIVE_POLL_S  # the last layer's window, or the copies still land (compute done)
                else:
                    cand = tick  # later than any prediction and nothing landing: a stalled or slow sender
            best = min(best, cand)
        if window:
            return min(pace.next_timeout(ACTIVE_POLL_S), best)
        return best

    def _handle(self, remote: str, msg: bytes) -> Kind | None:
        """Act on one notification; returns its kind, or None when it was for no live reservation."""
        frame = unpack(msg)
        payload = msg[HEADER_SIZE : HEADER_SIZE + frame.payload_len] if frame.kind != Kind.DATA else b""
        if frame.kind == Kind.QUIET:
            self._on_quiet(frame.transfer_id, remote)
            return frame.kind
        entry = self._live(frame.transfer_id)
        if frame.kind == Kind.HELLO:
            try:
                layout, name, metadata = parse_hello(payload)
                if name not in self._agent.known:
                    self._agent.add_remote(metadata)
                if entry is None:  # decode often aborts while the HELLO is queued: FAIL frees the sender's blocks now
                    self._control_frame(frame, payload, name)
                    return None
                self._on_hello(entry, layout, name)
                self._accept(entry, name)
                if frame.transfer_id not in self._pace:  # the first sender's HELLO starts the clock
                    self._pace[frame.transfer_id] = _Pace(max(self._poll_prev, entry.started), self._poll_now)
            except ValueError as e:
                if entry is None:
                    return None
                self._refuse_hello(entry, remote if remote in self._agent.known else None, e)
        elif entry is None:
            return None
        elif frame.kind == Kind.DATA:  # NIXL delivers this after the layer's WRITE completed
            pace, offset = self._pace.get(frame.transfer_id), handed_after(msg)
            if pace is not None and offset is not None:
                pace.note(frame.layer, offset, self._poll_now)
            self._landed(entry, frame)
        else:
            self._control(entry, frame, payload, remote)
        return frame.kind
