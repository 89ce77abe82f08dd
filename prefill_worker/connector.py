"""Prefill role: the engine's KV connector that streams each prompt's KV to its decode worker. Lifecycle, as queues::

    Bootstrap ──► Waiting ──► Inflight ──► (send DONE | FAILED | lease expired) ──► freed
    (destination   (engine      (prefill done: first token returned to the caller at once;
     checked)       schedules,   blocks held, layers still streaming to decode)
                    chunked)

- **Bootstrap** (:class:`Bootstrap`): ``Prefill`` arrives with decode's serialised destination. Its layout is checked
  against ours (model, dtype, block size, head geometry, layout) before any work; a mismatch is refused with the
  field named.
- **Waiting** (:class:`Waiting`): the request is an ordinary engine request generating one token, so it batches and
  chunks with everything else and reuses the prefix cache.
- **Inflight** (:class:`Inflight`): the step that computes the prompt's last chunk opens the send before its forward
  (so the transport's handshake, NIXL's HELLO and READY, overlaps layer 0), and each layer is handed to the sender
  the moment that layer's forward finishes (``save_kv_layer``), so the transfer
  overlaps the remaining layers. When the engine request finishes, ``request_finished`` has the engine hold its
  blocks, so the sender still reads intact KV; the first token goes back to the caller at once: TTFT never waits on
  the transfer. The hold ends when the sender reports DONE or FAILED (peer death, lease expiry), reported by
  ``get_finished``: every path frees the blocks. The sender wakes the engine loop the moment a transfer is DONE
  (that moment ends the request's :class:`TransferTiming`), so an idle loop frees the hold then.

A replica with TP ranks (``prefill_worker/ranks.py``) sends each rank's heads from that rank: rank 0 keeps its own
legs and gives each follower its legs with the step that completes the prompt; the hold ends once every rank's send
ended. Decode's destination may be several, one per decode rank (:meth:`Bootstrap.accept`).

The connector sees block ids only: the engine owns the pool, the tables and the cache tensors throughout.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_connector import EngineKV, FinishedTransfers, KVConnector
from engine.request import Request
from kvtransfer.base import DestinationInfo, KVSender, TransferState
from kvtransfer.layout import KVLayout
from prefill_worker.ranks import PrefillRanks

log = logging.getLogger(__name__)
MAX_DECODE_RANKS = 64  # destinations one Prefill may name (one per decode rank)


class Bootstrap:
    """The handshake: decode's destination, accepted only if its KV layout matches ours."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def accept(self, destination: bytes) -> tuple[DestinationInfo, ...]:
        """The destination (one per decode rank: a JSON array of them from a decode replica with TP ranks,
        ``decode_worker.ranks.encode_destinations``), checked (CompatibilityError on a layout mismatch, ValueError
        if malformed or if the ranks are not exactly one of each of the decode replica's TP ranks)."""
        if destination[:1] != b"[":
            dests: tuple[DestinationInfo, ...] = (DestinationInfo.from_bytes(destination),)
        else:
            try:
                docs = json.loads(destination)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"destinations are not valid JSON: {e}") from None
            if not isinstance(docs, list) or not 1 <= len(docs) <= MAX_DECODE_RANKS:
                raise ValueError(f"destinations must be a list of 1 to {MAX_DECODE_RANKS} destinations")
            dests = tuple(DestinationInfo.from_bytes(json.dumps(d).encode()) for d in docs)
        tp = dests[0].layout.tp_size
        if sorted((d.layout.tp_size, d.layout.tp_rank) for d in dests) != [(tp, r) for r in range(tp)]:
            raise ValueError(f"destinations must be one per decode rank of tp={tp}, got ranks "
                             f"{[(d.layout.tp_rank, d.layout.tp_size) for d in dests]}")
        if len({d.request_id for d in dests}) != 1:
            raise ValueError("destinations name different requests")
        for d in dests:
            self.layout.check_compatible(d.layout)
        return dests


@dataclass(slots=True)
class Waiting:
    """Requests in the engine whose KV goes to ``dests`` (one per decode rank) once their prompt's last chunk is
    computed; ``mine``: the legs this rank sends (all of them, unless the replica has ranks)."""

    dests: tuple[DestinationInfo, ...]
    deadline_s: float
    started_at: float = 0.0  # perf_counter when its first layer went to the sender (the send opens a step earlier)
    mine: tuple[DestinationInfo, ...] = ()


@dataclass(slots=True)
class Inflight:
    """Prefill done; the request's blocks are held until its send ends either way."""

    deadline_s: float
    compute_done: float  # perf_counter when the last layer's forward finished
    held_blocks: int = 0
    started_at: float = 0.0  # perf_counter when its first layer went to the sender


@dataclass(slots=True, frozen=True)
class TransferTiming:
    """How long a finished transfer outlived the compute it overlapped (for metrics and the overlap bench)."""

    request_id: str
    compute_done: float
    transfer_done: float
    ok: bool
    started: float = 0.0  # perf_counter when its first layer went to the sender
    bytes_sent: int = 0

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.transfer_done - self.compute_done)


class PrefillConnector(KVConnector):
    def __init__(self, sender: KVSender, layout: KVLayout, wake: Callable[[], object],
                 ranks: PrefillRanks | None = None) -> None:
        self.sender = sender
        self.ranks = ranks  # a replica with TP ranks: their sends (prefill_worker/ranks.py)
        self.layout = layout
        self.bootstrap = Bootstrap(layout)
        self.waiting: dict[str, Waiting] = {}
        self.inflight: dict[str, Inflight] = {}
        self._wake = wake
        self._kv: EngineKV | None = None
        self._sends: list[Request] = []  # the bound step's requests whose prompt completes in it
        self._gone: list[str] = []  # inflight requests cancelled: their holds are freed at the next step
        self.stall: tuple[int, float] | None = None  # fault injection: (layer, seconds)
        # Fault injection: each transfer's last layer (and so its end) goes out this long after the prefill
        # finished, while the first token has already gone back to the caller.
        self.transfer_delay_s = 0.0
        self._delayed: deque[tuple[float, str, int]] = deque()
        self.timings: deque[TransferTiming] = deque(maxlen=1024)
        self.totals = {"kv_transfers_done": 0, "kv_transfers_failed": 0, "kv_transfer_bytes": 0,
                       "kv_transfer_exposed_us": 0}  # since start, reported in Load (loop thread)
        self._done_at: dict[str, float] = {}  # perf_counter when the sender reported DONE (written on its thread)
        self.on_transfer: list[Callable[[TransferTiming], object]] = []  # each finished timing (metrics, traces)
        sender.set_on_done(self._on_done)

    def expect(self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], deadline_s: float) -> None:
        """``request_id``, just added to the engine, sends its prompt's KV to ``dest`` (Bootstrap → Waiting)."""
        dests = (dest,) if isinstance(dest, DestinationInfo) else tuple(dest)
        self.waiting[request_id] = Waiting(dests, deadline_s, mine=dests)

    def cancel(self, request_id: str) -> bool:
        """Stop ``request_id``'s send wherever it is (abort); its held blocks are freed at the next step."""
        found = request_id in self.waiting or request_id in self.inflight
        self.waiting.pop(request_id, None)
        if self.inflight.pop(request_id, None) is not None:
            self._gone.append(request_id)
        self._done_at.pop(request_id, None)
        self.sender.release(request_id)
        if self.ranks is not None:
            self.ranks.stop(request_id)
        return found

    # ---- scheduler side ------------------------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        infl = self.inflight.get(rid)
        if infl is not None:
            infl.held_blocks = len(block_ids)
            return True
        if self.ranks is not None and self.ranks.owes(rid):  # its send failed here, a follower may still read
            self.ranks.stop(rid)
            self._gone.append(rid)
            return True
        if self.waiting.pop(rid, None) is not None:  # ended before its final prefill step (aborted, failed)
            self.sender.release(rid)
        return False

    def has_pending(self) -> bool:
        return bool(self.inflight or self._gone)

    # ---- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv: EngineKV) -> None:
        self._kv = kv
        self.sender.register(list(kv.kv_caches), self.layout)

    def bind_step(self, requests: Sequence[Request], num_new_tokens: Sequence[int]) -> None:
        self._sends = []
        if self.waiting:
            self._sends = [r for r, n in zip(requests, num_new_tokens, strict=True)
                           if r.num_computed_tokens + n == r.num_tokens and r.request_id in self.waiting]
        if not self._sends:
            return
        kv = self._kv
        assert kv is not None  # registered when the connector was attached
        for req in list(self._sends):
            rid = req.request_id
            w = self.waiting[rid]
            nblocks = -(-req.num_prompt_tokens // kv.block_size)
            try:
                if self.ranks is not None:  # the followers' legs go with this step's rows
                    w.mine = self.ranks.split(rid, w.dests, kv.block_ids(rid)[:nblocks], w.deadline_s)
                # The send opens before the step's forward (its handshake, e.g. NIXL's HELLO and READY, overlaps
                # layer 0), and layer 0 goes out the moment that layer is computed.
                self.sender.start(rid, w.mine, kv.block_ids(rid)[:nblocks], w.deadline_s)
            except Exception as e:  # a broken transfer must not take the engine down
                self._drop(req, e)

    def save_kv_layer(self, layer: int) -> None:
        if not self._sends:
            return
        kv = self._kv
        assert kv is not None  # registered when the connector was attached
        last = layer == kv.num_layers - 1
        delay = last and self.transfer_delay_s > 0
        for req in list(self._sends):
            rid = req.request_id
            w = self.waiting.get(rid)
            if w is None:
                continue
            try:
                if not w.started_at:
                    w.started_at = time.perf_counter()
                if not delay:
                    self.sender.send_layer(rid, layer)
                if self.stall is not None and layer == self.stall[0]:
                    log.warning("fault injection: stalling %.1fs after layer %d of %s", self.stall[1], layer, rid)
                    time.sleep(self.stall[1])
                if last:
                    if delay:  # fault injection: the last layer and the transfer's end go out later
                        self._delayed.append((time.monotonic() + self.transfer_delay_s, rid, layer))
                    else:
                        self.sender.finish(rid)
                    self.inflight[rid] = Inflight(w.deadline_s, time.perf_counter(), started_at=w.started_at)
                    del self.waiting[rid]
            except Exception as e:  # a broken transfer must not take the engine down
                self._drop(req, e)

    def _drop(self, req: Request, error: Exception) -> None:
        """``req``'s send could not start or go on: it leaves this step's sends and Waiting, released."""
        log.warning("transfer of %s failed to start: %s", req.request_id, error)
        self.waiting.pop(req.request_id, None)
        self.sender.release(req.request_id)
        self._sends.remove(req)

    def get_finished(self) -> FinishedTransfers:
        done = FinishedTransfers()
        if self._gone:
            ranks = self.ranks
            done.sent = [rid for rid in self._gone if ranks is None or not ranks.owes(rid)]
            self._gone = [rid for rid in self._gone if ranks is not None and ranks.owes(rid)]
            for rid in done.sent:
                if ranks is not None:
                    ranks.close(rid)
        if self._delayed:
            self._send_delayed()
        if not self.inflight:
            return done
        now = time.time()
        for rid, infl in list(self.inflight.items()):
            st = self.sender.poll(rid)
            failure = None if self.ranks is None else self.ranks.failure(rid)
            if st.state < TransferState.DONE and now <= infl.deadline_s + 1.0 and failure is None:
                continue
            ok = st.state == TransferState.DONE and failure is None
            if self.ranks is not None and self.ranks.owes(rid):  # a follower still reads the held blocks
                if not ok:
                    self.ranks.stop(rid)
                continue
            nbytes = st.bytes_sent + (self.ranks.close(rid) if self.ranks is not None else 0)  # every rank's legs
            if not ok:
                log.info("KV transfer of %s failed: %s", rid, failure or st.error or "lease expired")
            done_at = self._done_at.pop(rid, None)
            end = done_at if ok and done_at is not None else time.perf_counter()
            timing = TransferTiming(rid, infl.compute_done, end, ok, infl.started_at, nbytes)
            self.timings.append(timing)
            for hook in self.on_transfer:
                hook(timing)
            self.totals["kv_transfers_done" if ok else "kv_transfers_failed"] += 1
            self.totals["kv_transfer_bytes"] += nbytes
            if ok:
                self.totals["kv_transfer_exposed_us"] += int(1e6 * max(0.0, end - infl.compute_done))
            del self.inflight[rid]
            self.sender.release(rid)
            done.sent.append(rid)
        return done

    def _send_delayed(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, rid, layer = self._delayed.popleft()
            if rid in self.inflight:
                try:
                    self.sender.send_layer(rid, layer)
                    self.sender.finish(rid)
                except Exception as e:  # as in save_kv_layer: the transfer fails, the engine goes on
                    log.warning("delayed transfer of %s failed: %s", rid, e)

    def _on_done(self, request_id: str) -> None:
        # Sender thread: note the moment (the timing's end), then wake the engine loop, whose next step polls it.
        if request_id in self.inflight or request_id in self.waiting:
            self._done_at[request_id] = time.perf_counter()
        self._wake()

    # ---- what the worker reports ----------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        """Transfers in flight, blocks held for them, and the totals since start (loop thread)."""
        return {"transfers_in_flight": len(self.inflight),
                "held_blocks": sum(i.held_blocks for i in self.inflight.values()), **self.totals}
