"""The router's view of its workers: connections, health, load reports and their KV event streams.

Workers come from static addresses (``tandem up``, config) or the Redis registry. For each worker the pool keeps a
``grpc.aio`` channel, polls ``Load`` every ``poll_interval_s`` (feeding the load tracker) and follows its
``KVEvents`` stream into the KV index, resyncing from ``Snapshot`` whenever the index reports a sequence gap or
the stream breaks. A worker that fails health checks is marked down and gets no requests until it answers again;
a draining worker is kept for in-flight work but gets nothing new. Health is re-read every ``HEALTH_REFRESH_S``
besides, so that a worker drained by its controller (its ``Drain`` RPC) is seen draining within that time even
without a registry; draining is one-way (a worker never leaves it), so the flag, once seen or set here by the
controller of ``tandem up``, stays set.

Late is not gone: on a loaded host a live worker (or this router's own starved loop) can miss a probe's deadline,
so a probe that times out takes nothing away by itself; only one the worker refuses (``UNAVAILABLE``: its port is
closed, the process is gone) or a ``Health`` answer that says so (draining, failed) marks it down at once. One
request's failure on a worker does not either: the dispatcher asks the pool to probe the worker now
(:meth:`WorkerPool.suspect`), and the probe's answer decides, so that one client's failed request never turns
every other client's into ``503 no decode worker is available``.

A worker that answers no probe (``Load`` or ``Health``) and delivers nothing on its streams (its session, its
``Decode`` calls) for ``dead_after_s`` is cut off; traffic counts as an answer, so a saturated worker whose probes
are slow is busy, not dead (the worker answers ``Health`` off its engine loop, worker/aio_service.py). Cut off:
its session stream is broken and its in-flight gRPC calls (registered in ``Worker.calls`` by the dispatcher) are
cancelled, so every request on it fails with ``UNAVAILABLE`` at once and is retried or migrated elsewhere,
instead of waiting for the request's own deadline (minutes) on a host that crashed without closing its
connections, a partitioned network or a stopped process. A worker that answers again is used again.

Each worker's LoRA adapters (name -> content hash, and which are loaded now) come from its ``Health`` answers, from
its registry entry (router/redis_bus.py) and from the answers of the load and unload calls the router makes
(router/lora_admin.py), whichever is newest; :meth:`WorkerPool.adapters` is their union, what ``/v1/models`` lists.

Every channel carries the pool's credentials (auth/): mutual TLS when the router holds TLS files, on the gRPC
channel and the session port alike, and the cluster token on every call, which the workers' admin RPCs
(``Snapshot``, ``KVEvents``, ``Abort``, ``Drain``) require.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from auth.credentials import Credentials
from auth.grpc_client import aio_channel, attach
from auth.tls import client_context
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.session import WorkerSession, host_of

log = logging.getLogger(__name__)
HEALTH_REFRESH_S = 1.0
REMOVE_GRACE_S = 10.0  # the longest remove() waits for this router's requests on a worker that still answers


class IndexSink(Protocol):
    def apply(self, worker_id: str, seq: int, hashes: list[int], kinds: bytes) -> bool: ...
    def resync(self, worker_id: str, seq: int, hashes: list[int]) -> None: ...
    def remove_worker(self, worker_id: str) -> object: ...  # KVIndex says whether it knew the worker


class LoadSink(Protocol):
    def update_from_report(self, worker_id: str, waiting: int, running: int, active_tokens: int,
                           used_blocks: int, total_blocks: int) -> None: ...


@dataclass(slots=True)
class Worker:
    address: str
    role: str = ""
    worker_id: str = ""
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.WorkerStub | None = None
    session: WorkerSession | None = None  # colocated requests, multiplexed (router/session.py)
    healthy: bool = False
    draining: bool = False
    compat_hash: str = ""
    mismatch: str = ""  # why this worker is refused (it hashes KV blocks differently from the router), or ""
    last_load: pb.LoadResponse | None = None
    last_seen: float = 0.0
    health_at: float = 0.0  # when Health last answered
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    calls: set[Any] = field(default_factory=set)  # in-flight gRPC calls a cut-off cancels (router/dispatch.py)
    unanswered_since: float | None = None  # when the first probe that got no answer was sent
    last_traffic: float = 0.0  # monotonic time a Decode stream last delivered from it (router/dispatch.py)
    cut_off: bool = False  # silent for dead_after_s: everything on it was failed over
    cutoffs: int = 0  # times it was cut off (tandem_router_worker_cutoffs_total)
    kv_backend: str = ""  # its KV transfer backend, from Health (a metrics label)
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapters it serves: name -> content hash
    resident_loras: frozenset[str] = frozenset()  # those of them loaded now (the others are read from disk first)

    @property
    def answering(self) -> bool:
        """It has answered a probe, and the latest probe, or only answered late since (still healthy, not cut off):
        its connections are alive, whatever the registry says (a lease a starved heartbeat let lapse included)."""
        return self.last_seen > 0 and (self.unanswered_since is None or self.healthy) and not self.cut_off

    def set_adapters(self, infos: Iterable[pb.LoRAAdapterInfo]) -> None:
        """Take the worker's adapter list (Health, or a load or unload call's answer)."""
        infos = list(infos)
        self.loras = {a.name: a.content_hash for a in infos}
        self.resident_loras = frozenset(a.name for a in infos if a.resident)

    @property
    def serves_prefill(self) -> bool:
        return self.role == "prefill"

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")


class WorkerPool:
    def __init__(self, addresses: list[str], index: IndexSink | None = None, load: LoadSink | None = None,
                 poll_interval_s: float = 0.2, hashing: tuple[int, tuple[str, ...]] | None = None,
                 dead_after_s: float = 10.0, credentials: Credentials | None = None) -> None:
        """``hashing`` is the router's ``(block_size, extra_keys)``; a worker that reports another is refused.
        ``dead_after_s``: how long a worker may answer no probe before everything on it is failed over.
        ``credentials``: TLS files and cluster token for the workers (default: this process's cluster token,
        auth.credentials.Credentials.for_cluster, without TLS)."""
        if dead_after_s <= 0:
            raise ValueError(f"dead_after_s must be > 0, not {dead_after_s}")
        self.dead_after_s = dead_after_s
        self.workers: dict[str, Worker] = {a: Worker(a) for a in addresses}
        self.index = index
        self.load = load
        self.hashing = hashing
        self.poll_interval_s = poll_interval_s
        self.credentials = credentials if credentials is not None else Credentials.for_cluster()
        tls = self.credentials.tls
        self._ssl = None if tls is None else (client_context(tls), tls.server_name)
        self._closing = False
        self._suspected: dict[str, asyncio.Task[bool]] = {}  # address -> the Health probe a failure asked for

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        for w in self.workers.values():
            self._connect(w)
        deadline = time.monotonic() + ready_timeout_s
        while not all(w.healthy for w in self.workers.values()):
            await asyncio.gather(*(self._health(w) for w in self.workers.values()))
            refused = [f"{w.address}: {w.mismatch}" for w in self.workers.values() if w.mismatch]
            if refused:
                raise ValueError("workers hash KV blocks differently from this router: " + "; ".join(refused))
            if all(w.healthy for w in self.workers.values()):
                break
            if time.monotonic() > deadline:
                down = [w.address for w in self.workers.values() if not w.healthy]
                raise TimeoutError(f"workers not healthy after {ready_timeout_s}s: {down}")
            await asyncio.sleep(0.1)
        for w in self.workers.values():
            w.tasks.append(asyncio.create_task(self._poll(w)))
            if self.index is not None:
                w.tasks.append(asyncio.create_task(self._follow_events(w)))

    def add(self, address: str) -> Worker:
        w = self.workers.get(address)
        if w is None:
            w = self.workers[address] = Worker(address)
            self._connect(w)
            w.tasks.append(asyncio.create_task(self._poll(w)))
            if self.index is not None:
                w.tasks.append(asyncio.create_task(self._follow_events(w)))
        return w

    async def remove(self, address: str, grace_s: float = REMOVE_GRACE_S) -> None:
        """Take ``address`` out of the pool and close its connections. While it still answers, wait up to
        ``grace_s`` for this router's own requests on it (its session's and its gRPC calls) to end first: a drained
        worker reports nothing in flight once it has sent its last tokens, which may still be on the wire here, and
        closing the session under them would fail (and retry) requests that were complete."""
        w = self.workers.get(address)
        if w is None:
            return
        deadline = time.monotonic() + grace_s
        while (w.calls or (w.session is not None and w.session.in_flight)) and w.answering \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.workers.get(address) is not w:
            return  # removed meanwhile
        del self.workers[address]
        probe = self._suspected.pop(address, None)
        for t in (*w.tasks, *([probe] if probe is not None else [])):
            t.cancel()
        if self.index is not None and w.worker_id:
            self.index.remove_worker(w.worker_id)
        if w.session is not None:
            await w.session.close()
        if w.channel is not None:
            await w.channel.close()

    async def close(self) -> None:
        self._closing = True
        for a in list(self.workers):
            await self.remove(a, grace_s=0.0)

    def _connect(self, w: Worker) -> None:
        w.channel = aio_channel(w.address, self.credentials, options=[("grpc.max_receive_message_length", 64 << 20)])
        w.stub = attach(pb_grpc.WorkerStub(w.channel), self.credentials)
        w.session = WorkerSession(w.stub, w.address, tls=self._ssl)

    def available(self, role: str) -> list[Worker]:
        """Healthy, non-draining workers that serve ``role`` (``prefill`` or ``decode``)."""
        roles = ("prefill",) if role == "prefill" else ("decode", "both")  # serves_prefill / serves_decode
        return [w for w in self.workers.values() if w.healthy and not w.draining and w.role in roles]

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter some worker of the pool serves: name -> its content hash (the first seen, should
        workers serve different content under one name)."""
        out: dict[str, str] = {}
        for w in self.workers.values():
            for name, digest in w.loras.items():
                out.setdefault(name, digest)
        return out

    def by_id(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.worker_id == worker_id), None)

    def mark_down(self, w: Worker) -> None:
        if w.healthy:
            log.warning("worker %s (%s) marked down", w.worker_id, w.address)
        w.healthy = False

    def suspect(self, w: Worker) -> None:
        """A request failed on ``w``: probe its ``Health`` now (one probe at a time per worker) and let the answer
        decide, instead of taking the worker from every other request on one request's failure (a KV transfer
        that failed, a stream one client's slowness broke). A refused probe or a NOT_SERVING answer marks it down;
        a late one changes nothing (silence is judged by ``dead_after_s``)."""
        probe = self._suspected.get(w.address)
        if self._closing or w.stub is None or self.workers.get(w.address) is not w \
                or (probe is not None and not probe.done()):
            return  # closing, or a request on a worker removed meanwhile (its channel is closed)
        task = self._suspected[w.address] = asyncio.get_running_loop().create_task(self._health(w))

        def done(t: asyncio.Task[bool]) -> None:
            if self._suspected.get(w.address) is t:
                del self._suspected[w.address]

        task.add_done_callback(done)

    async def _health(self, w: Worker) -> bool:
        """Ask ``w`` for its health and apply the answer; False if it did not answer."""
        assert w.stub is not None
        try:
            h = await w.stub.Health(pb.HealthRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            # A refusal means the worker is gone; a timeout only that it (or this loop) is slow now: a worker whose
            # probes keep timing out is cut off after dead_after_s (_unanswered), not on the first late answer.
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                w.healthy = False
            return False
        w.role, w.worker_id, w.draining, w.compat_hash = h.role, h.worker_id, w.draining or h.draining, h.compat_hash
        w.kv_backend = h.kv_backend
        w.set_adapters(h.lora_adapters)
        if w.session is not None:  # the worker's plain-TCP Session port, on the host its gRPC address names
            w.session.use_tcp(host_of(w.address), h.session_port)
        mismatch = self._hashing_mismatch(h)
        if mismatch and mismatch != w.mismatch:
            log.error("refusing worker %s (%s): %s", h.worker_id, w.address, mismatch)
        w.mismatch = mismatch
        w.healthy = h.status == "SERVING" and not mismatch
        w.last_seen = w.health_at = time.monotonic()
        return True

    def _hashing_mismatch(self, h: pb.HealthResponse) -> str:
        """Why ``h``'s block hashing differs from the router's, naming the field; "" when it agrees."""
        if self.hashing is None or not h.block_size:  # no expectation, or a worker that does not report it
            return ""
        block_size, keys = self.hashing
        if h.block_size != block_size:
            return f"block_size {h.block_size} != router's {block_size}"
        if tuple(h.hash_extra_keys) != keys:
            return f"hash_extra_keys {tuple(h.hash_extra_keys)} != router's {keys} (serve the same model name)"
        return ""

    async def _poll(self, w: Worker) -> None:
        while not self._closing:
            assert w.stub is not None
            sent = time.monotonic()
            try:
                ld = await w.stub.Load(pb.LoadRequest(), timeout=2.0)
                w.last_load = ld
                w.last_seen = time.monotonic()
                self._answered(w)
                if not w.healthy or w.last_seen - w.health_at >= HEALTH_REFRESH_S:
                    await self._health(w)
                if self.load is not None and w.worker_id:
                    self.load.update_from_report(w.worker_id, ld.waiting, ld.running + ld.waiting_for_kv,
                                                 ld.active_tokens, ld.used_blocks, ld.total_blocks)
            except grpc.aio.AioRpcError:
                # Load waits for the engine's loop; Health does not: a busy worker still answers it. One that
                # answers neither counts as silent (cut off after dead_after_s) and is marked down at once only if
                # it refused the probe (_health). A slow one stays available meanwhile: its requests queue there,
                # rather than failing with "no worker".
                was_healthy = w.healthy
                if await self._health(w):
                    self._answered(w)
                else:
                    if was_healthy and not w.healthy:
                        log.warning("worker %s (%s) marked down: it refuses probes", w.worker_id, w.address)
                    self._unanswered(w, sent)
            await asyncio.sleep(self.poll_interval_s)

    def _answered(self, w: Worker) -> None:
        if w.cut_off:
            log.warning("worker %s (%s) answers again", w.worker_id, w.address)
        w.unanswered_since = None
        w.cut_off = False

    def _unanswered(self, w: Worker, sent: float) -> None:
        if w.unanswered_since is None:
            w.unanswered_since = sent
        # Traffic is an answer too: a worker whose streams deliver tokens is busy, not dead, even when its probes
        # time out (its host is saturated), so silence counts from the later of the two.
        traffic = max(w.last_traffic, w.session.last_received if w.session is not None else 0.0)
        silent = time.monotonic() - max(w.unanswered_since, traffic)
        if not w.cut_off and silent >= self.dead_after_s:
            self.cut_off(w, f"worker {w.worker_id or w.address} answered no probe for {silent:.1f}s")

    def cut_off(self, w: Worker, why: str) -> None:
        """Fail everything in flight on ``w`` now (``UNAVAILABLE``: retried or migrated by the dispatcher)."""
        w.cut_off = True
        w.cutoffs += 1
        w.healthy = False
        calls = list(w.calls)
        in_flight = len(calls) + (w.session.in_flight if w.session is not None else 0)
        log.error("cutting off %s: %s; failing over %d in-flight requests", w.address, why, in_flight)
        if w.session is not None:
            w.session.sever(why)
        for call in calls:
            call.cancel()

    async def _follow_events(self, w: Worker) -> None:
        """Apply the worker's KV events to the index; resync from a snapshot on a gap or reconnect."""
        assert self.index is not None
        while not self._closing:
            assert w.stub is not None
            try:
                snap = await w.stub.Snapshot(pb.SnapshotRequest(), timeout=10.0)
                self.index.resync(snap.worker_id, snap.seq, list(snap.hashes))
                async for batch in w.stub.KVEvents(pb.KVEventsRequest(after_seq=snap.seq)):
                    if not self.index.apply(batch.worker_id, batch.seq, list(batch.hashes), batch.kinds):
                        break  # gap: resync
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                raise
