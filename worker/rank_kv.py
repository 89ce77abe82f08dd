"""A follower rank's own KV transfer endpoint (a :class:`engine.parallel.replica.RankExtension`), made in the rank's
process for its own heads: a sender on a prefill rank, a receiver on a decode rank.

Rank 0 builds one :class:`RankKV` (picklable: the backend's name, the TP degree, the layout and the transport's
settings) and every follower starts it for its ``KVLayout(tp_size, tp_rank)``. What it does, as rank 0 asks
(``engine/parallel/replica.py`` says how the messages travel):

- prefill, with a step: ``("send", request_id, destinations, src_block_ids, deadline_s)`` for each request whose
  prompt completes in that step, the legs this rank sends; the send starts at layer 0 and each layer is handed to
  the sender right after this rank's forward of it, as rank 0's connector does;
- decode, a call: ``("reserve", request_id, block_ids, num_tokens, deadline_s)`` opens a receive on rank 0's block
  ids (this rank's cache has the same blocks) and answers the serialised destination;
- a tell: ``("release", request_id)`` forgets the request (a send still going is cancelled, bytes still arriving are
  discarded), answered by the report ``("released", request_id)`` once nothing can be written into its blocks any
  more (at once, except for a NIXL receive a sender may still WRITE into: when its receiver lists it ``quiet()``).

A reporter thread polls the transport and reports each outcome once: ``("sent", request_id, ok, error, bytes)``
when a send ended (released here at once: this rank reads its blocks no more), ``("landed", request_id, ok,
error)`` when a receive landed or failed (released when rank 0 says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtransfer import DestinationInfo, KVLayout, KVReceiver, KVSender, TransferConfig, TransferState, get_backend

if TYPE_CHECKING:
    from auth.tls import TLSFiles
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
POLL_S = 0.01  # the reporter's backstop tick while transfers are watched; a finished or failed one wakes it at once
IDLE_S = 0.5  # its tick with nothing watched (a rank of an idle replica costs no wake-ups)


def kv_layout(engine: LLMEngine, tp: int, tp_rank: int) -> KVLayout:
    """The KV layout of ``engine``'s cache as rank ``tp_rank`` of ``tp`` holds it (the model id hashes config.json,
    so workers of different checkpoints never exchange KV)."""
    cfg = engine.model_config
    digest = hashlib.sha256((Path(engine.config.model) / "config.json").read_bytes()).hexdigest()[:12]
    return KVLayout(model_id=f"{cfg.architecture}:{digest}", dtype=engine.config.dtype, num_layers=cfg.num_layers,
                    block_size=engine.block_size, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    tp_size=tp, tp_rank=tp_rank)


@dataclass(slots=True)
class _Watch:
    deadline_s: float  # wall clock, as the leases


class RankKV:
    """Picklable; ``start`` builds the transport in the follower process."""

    def __init__(self, role: str, backend: str, tp: int, io_cpus: tuple[int, ...] = (),
                 tls: TLSFiles | None = None) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"rank KV serves prefill or decode, not {role!r}")
        self.role, self.backend, self.tp, self.io_cpus, self.tls = role, backend, tp, io_cpus, tls

    def __getstate__(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in ("role", "backend", "tp", "io_cpus", "tls")}

    def __setstate__(self, state: dict[str, object]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def _config(self) -> TransferConfig:
        if self.tls is None:
            return TransferConfig(io_cpus=self.io_cpus)
        from auth.tls import client_context, server_context

        return TransferConfig(io_cpus=self.io_cpus, tls_server=server_context(self.tls),
                              tls_client=client_context(self.tls), tls_server_name=self.tls.server_name)

    # ---- RankExtension -------------------------------------------------------------------------------------

    def start(self, rank: int, engine: LLMEngine, report: Callable[[object], None]) -> None:
        self.rank_layout = kv_layout(engine, self.tp, rank % self.tp)
        self.num_layers = engine.model_config.num_layers
        self.report = report
        self.lock = threading.Lock()
        self.watch: dict[str, _Watch] = {}
        self.held: set[str] = set()  # released receives a sender may still write into: answered once quiet
        self.wake = threading.Event()
        self.stop = threading.Event()
        sender_cls, receiver_cls = get_backend(self.backend)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        side: KVSender | KVReceiver
        if self.role == "prefill":
            side = self.sender = sender_cls(self._config(), on_failed=lambda rid, msg: self.wake.set())
        else:
            side = self.receiver = receiver_cls(self._config(), on_failed=lambda rid, msg: self.wake.set())
        side.set_on_done(lambda rid: self.wake.set())
        side.register(list(engine.kv_caches), self.rank_layout)
        self.side = side
        self.thread = threading.Thread(target=self._reporter, name="rank-kv-reporter", daemon=True)
        self.thread.start()

    def before_step(self, items: list[object]) -> Callable[[int], None] | None:
        orders = [item for item in items if isinstance(item, tuple) and item[0] == "send"]
        if not orders:
            return None
        failed: set[str] = set()

        def after_layer(layer: int) -> None:
            for _, rid, dests, src_ids, deadline_s in orders:
                if rid not in failed:
                    self._send_layer(rid, dests, src_ids, deadline_s, layer, failed)

        return after_layer

    def call(self, payload: object) -> object:
        if not isinstance(payload, tuple) or payload[0] != "reserve" or self.receiver is None:
            raise ValueError(f"a {self.role} rank answers no call {payload!r}")
        _, rid, block_ids, num_tokens, deadline_s = payload
        dest = self.receiver.reserve(rid, block_ids, num_tokens, deadline_s)
        with self.lock:
            self.watch[rid] = _Watch(deadline_s)
        return dest.to_bytes()

    def tell(self, payload: object) -> None:
        if isinstance(payload, tuple) and payload[0] == "release":
            rid = payload[1]
            with self.lock:
                self.watch.pop(rid, None)
            if self.receiver is None:
                self.side.release(rid)
            elif self.receiver.release(rid):
                with self.lock:
                    self.held.add(rid)
                self.wake.set()
                return
            self.report(("released", rid))

    def close(self) -> None:
        if not hasattr(self, "side"):  # the rank failed before its transport was up
            return
        self.stop.set()
        self.wake.set()
        self.thread.join(1.0)
        self.side.close()

    # ---- prefill: this rank's legs, layer by layer -----------------------------------------------------------

    def _send_layer(self, rid: str, dests: tuple[bytes, ...], src_ids: list[int], deadline_s: float, layer: int,
                    failed: set[str]) -> None:
        sender = self.sender
        assert sender is not None
        try:
            if layer == 0:
                sender.start(rid, [DestinationInfo.from_bytes(d) for d in dests], src_ids, deadline_s)
                with self.lock:
                    self.watch[rid] = _Watch(deadline_s)  # the entry stays in the sender's book until released
            sender.send_layer(rid, layer)
            if layer == self.num_layers - 1:
                sender.finish(rid)
        except Exception as e:  # a broken leg fails this request on every rank, never the step
            log.warning("rank %d: send of %s failed: %s", self.rank_layout.tp_rank, rid, e)
            failed.add(rid)
            with self.lock:
                self.watch.pop(rid, None)
            sender.release(rid)
            self.report(("sent", rid, False, f"rank {self.rank_layout.tp_rank}: {e}", 0))

    # ---- the reporter ----------------------------------------------------------------------------------------

    def _reporter(self) -> None:
        watched: list[tuple[str, _Watch]] = []
        while not self.stop.is_set():
            self.wake.wait(POLL_S if watched or self.held else IDLE_S)
            self.wake.clear()
            with self.lock:
                watched = list(self.watch.items())
            if self.held and self.receiver is not None:
                for rid in self.receiver.quiet():
                    with self.lock:
                        self.held.discard(rid)
                    with contextlib.suppress(OSError):
                        self.report(("released", rid))
            now = time.time()
            for rid, w in watched:
                try:
                    st = self.side.poll(rid)
                except KeyError:  # released by rank 0 since the snapshot
                    continue
                expired = st.state < TransferState.DONE and now > w.deadline_s + 1.0
                if st.state < TransferState.DONE and not expired:
                    continue
                ok = st.state == TransferState.DONE
                error = "" if ok else f"rank {self.rank_layout.tp_rank}: {st.error or 'lease expired'}"
                with self.lock:
                    if self.watch.pop(rid, None) is None:
                        continue  # released meanwhile
                if self.sender is not None:
                    self.sender.release(rid)
                    msg: object = ("sent", rid, ok, error, st.bytes_sent)
                else:
                    msg = ("landed", rid, ok, error)
                with contextlib.suppress(OSError):
                    self.report(msg)
