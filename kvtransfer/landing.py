"""Receiver-side bookkeeping shared by every backend: reservations, validation of incoming pieces, completion.

Incoming DATA is checked against the reservation before a byte is written; bytes for an unknown, released, failed
or expired request are discarded, since the engine may have reused those blocks. A request is DONE when every layer
landed (possibly from several source ranks); a FINISH from every source with bytes missing is a failure.
``release`` waits for a write in progress on the receiver's own threads, so nothing is written after it and it returns
False (free the blocks now); NIXL, whose senders write on their own, overrides it (:mod:`kvtransfer.nixl_backend`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.base import DestinationInfo, KVCaches, KVReceiver, TransferState
from kvtransfer.book import Entry, OnFailed
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout, RegisteredKV
from kvtransfer.plan import tp_head_map
from kvtransfer.wire import Frame, Kind, control, parse_hello


@dataclass(slots=True)
class Reservation:
    transfer_id: int
    dst_set: frozenset[int]
    layer_expected: int
    layer_bytes: list[int]
    expected_senders: int = 0  # known at the first HELLO (depends on the source TP)
    finishes: int = 0
    peers: list[Any] = field(default_factory=list)  # backend handles to answer ACK/FAIL on
    accepted: set[Any] = field(default_factory=set)  # NIXL: peers sent READY (they may WRITE until their QUIET)
    quiet: set[Any] = field(default_factory=set)  # NIXL: peers that sent QUIET (they never write again)


class LandingReceiver(KVReceiver):
    """A receiver over its registered KV (``self.landing``) and its reservations, by transfer id; ``endpoint`` is
    where its senders reach it, ``_published`` what else the hand-off carries."""

    endpoint: str

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        super().__init__(config, on_failed)
        self.landing = RegisteredKV()
        self._by_tid: dict[int, Entry] = {}
        # Transfer ids are unique per receiver and hard to guess across receivers (a stale sender of a previous
        # process incarnation cannot hit a live reservation by accident).
        self._tids = itertools.count(random.Random(os.urandom(8)).getrandbits(40) << 20)

    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        self.landing.register(kv_caches, layout)

    def _layout(self) -> KVLayout:
        if self.landing.layout is None:
            raise RuntimeError(f"{self.backend_name} receiver: register() the KV caches first")
        return self.landing.layout

    def _published(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint}

    def reserve(self, request_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                deadline_s: float) -> DestinationInfo:
        layout, num_blocks = self._layout(), self.landing.num_blocks
        ids = tuple(int(b) for b in dst_block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"reserve {request_id!r}: duplicate block ids")
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"reserve {request_id!r}: block id outside [0, {num_blocks})")
        if -(-num_tokens // layout.block_size) != len(ids):
            raise ValueError(f"reserve {request_id!r}: {num_tokens} tokens do not fill {len(ids)} blocks")
        tid = next(self._tids)
        res = Reservation(tid, frozenset(ids), 2 * len(ids) * layout.block_bytes, [0] * layout.num_layers)
        dest = DestinationInfo(backend=self.backend_name, request_id=request_id, transfer_id=tid, layout=layout,
                               dst_block_ids=ids, num_tokens=num_tokens, deadline_s=deadline_s,
                               compat_hash=layout.compat_hash(), **self._published())
        with self.book.lock:
            entry = self.book.add(request_id, deadline_s, res)
            self._by_tid[tid] = entry
        return dest

    def release(self, request_id: str) -> bool:
        entry = self.book.find(request_id)
        if entry is not None:
            self.book.fail(entry, "receiver: released before completion", notify_peer=True, tell_owner=False)
            end = time.monotonic() + self.config.close_timeout_s
            while entry.busy and time.monotonic() < end:  # a write in progress on a receiver thread ends first
                time.sleep(0.001)
        with self.book.lock:
            entry = self.book.pop(request_id)
            if entry is not None:
                self._by_tid.pop(entry.ctx.transfer_id, None)
        return False  # every byte is written by this receiver's threads, and none after the wait above

    def _live(self, tid: int) -> Entry | None:
        """The entry for ``tid`` if bytes for it may still be written."""
        with self.book.lock:
            entry = self._by_tid.get(tid)
            return entry if entry is not None and entry.state < TransferState.DONE else None

    def _in_flight(self) -> list[Entry]:
        """The reservations that may still receive bytes (not yet DONE, FAILED or released)."""
        with self.book.lock:
            return [e for e in self._by_tid.values() if e.state < TransferState.DONE]

    def _on_hello(self, entry: Entry, sender: KVLayout, peer: Any) -> None:
        """Check a sender's layout; raises ``CompatibilityError``/``ValueError`` (caller fails the entry)."""
        layout = self._layout()
        layout.check_compatible(sender)
        senders = len(tp_head_map(layout.num_kv_heads, sender.tp_size, layout.tp_size)[layout.tp_rank])
        with self.book.lock:
            res: Reservation = entry.ctx
            res.expected_senders = senders
            if peer is not None and peer not in res.peers:
                res.peers.append(peer)
            if entry.state == TransferState.PENDING:
                entry.state = TransferState.IN_FLIGHT

    def _view(self, frame: Frame) -> torch.Tensor:
        """The destination view of an admitted DATA frame."""
        t = self.landing.kv_caches[frame.layer][frame.kv]
        return t[frame.dst_start : frame.dst_start + frame.num_blocks, :, frame.head_lo : frame.head_hi]

    def _admit(self, entry: Entry, frame: Frame) -> bool:
        """Whether a DATA frame lies inside the lease (layer, K/V, heads, blocks, length); if not, the request fails
        and its senders are told."""
        layout = self._layout()
        blocks = range(frame.dst_start, frame.dst_start + frame.num_blocks)
        want = frame.num_blocks * (frame.head_hi - frame.head_lo) * layout.block_bytes // layout.local_heads
        if not 0 <= frame.layer < layout.num_layers or frame.kv not in (0, 1):
            error = f"DATA for layer {frame.layer} kv {frame.kv} is out of range"
        elif not 0 <= frame.head_lo < frame.head_hi <= layout.local_heads:
            error = f"DATA heads [{frame.head_lo}, {frame.head_hi}) outside {layout.local_heads}"
        elif frame.num_blocks < 1 or not entry.ctx.dst_set.issuperset(blocks):
            error = f"DATA blocks [{blocks.start}, {blocks.stop}) are not all reserved"
        elif frame.payload_len != want:
            error = f"DATA payload {frame.payload_len} bytes, expected {want}"
        else:
            return True
        self.book.fail(entry, f"receiver: refused DATA: {error}", notify_peer=True)
        return False

    def _landed(self, entry: Entry, frame: Frame) -> None:
        """Account a DATA frame's bytes; when that made the request DONE, ACK every sender."""
        with self.book.lock:
            if entry.state >= TransferState.DONE:
                return
            res: Reservation = entry.ctx
            before = res.layer_bytes[frame.layer]
            res.layer_bytes[frame.layer] = before + frame.payload_len
            entry.nbytes += frame.payload_len
            if entry.state == TransferState.PENDING:
                entry.state = TransferState.IN_FLIGHT
            if before < res.layer_expected <= res.layer_bytes[frame.layer]:
                entry.layers_done += 1
            if entry.layers_done < len(res.layer_bytes) or not self.book.done(entry):
                return
        self._tell(entry, control(Kind.ACK, frame.transfer_id))

    def _send(self, peer: Any, data: bytes) -> None:
        """Send ``peer`` a small control frame (ACK, FAIL) without blocking."""
        peer.send_control(data)

    def _tell(self, entry: Entry, data: bytes) -> None:
        for peer in list(entry.ctx.peers):
            with contextlib.suppress(OSError):
                self._send(peer, data)

    def _notify_peer(self, entry: Entry, message: str) -> None:
        self._tell(entry, control(Kind.FAIL, entry.ctx.transfer_id, message.encode()))

    def _control_frame(self, frame: Frame, payload: bytes, peer: Any) -> None:
        """A control frame from ``peer``; a HELLO for no live reservation is answered with FAIL at once, so the
        sender does not wait out its lease."""
        entry = self._live(frame.transfer_id)
        if entry is not None:
            self._control(entry, frame, payload, peer)
        elif frame.kind == Kind.HELLO:
            with contextlib.suppress(OSError):
                self._send(peer, control(Kind.FAIL, frame.transfer_id, b"receiver: no live reservation for this "
                                         b"transfer (released, failed or lease expired)"))

    def _refuse_hello(self, entry: Entry, peer: Any, error: ValueError) -> None:
        """A HELLO that does not fit the reservation: fail it, and tell ``peer`` (which sent it) why."""
        with self.book.lock:
            if peer is not None and peer not in entry.ctx.peers:
                entry.ctx.peers.append(peer)
        self.book.fail(entry, f"receiver: {error}", notify_peer=True)

    def _control(self, entry: Entry, frame: Frame, payload: bytes, peer: Any) -> None:
        """A HELLO, FINISH or FAIL frame from ``peer`` for the live reservation ``entry``. A FINISH from every sender
        with bytes missing fails the request."""
        if frame.kind == Kind.HELLO:
            try:
                self._on_hello(entry, parse_hello(payload)[0], peer)
            except ValueError as e:
                self._refuse_hello(entry, peer, e)
        elif frame.kind == Kind.FINISH:
            with self.book.lock:
                res: Reservation = entry.ctx
                res.finishes += 1
                if entry.state < TransferState.DONE and res.finishes >= max(res.expected_senders, 1):
                    want = res.layer_expected * len(res.layer_bytes)
                    self.book.fail(entry, f"receiver: sender finished but only {entry.nbytes} of {want} bytes "
                                   f"landed ({entry.layers_done}/{len(res.layer_bytes)} layers)", notify_peer=True)
        elif frame.kind == Kind.FAIL:
            self.book.fail(entry, f"receiver: sender reported: {payload.decode(errors='replace')}")
