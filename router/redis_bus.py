"""A router's side of the Redis bus: worker discovery from leases, and the shared KV event stream.

Every router replica reads the one stream from its beginning, in order, so all replicas apply the same events in
the same order and hold the same index: a request that hits the cache through one replica hits it through all.
Per worker, sequence numbers must increase by one; an entry at or below the last applied one is a duplicate
(skipped), one further ahead is a gap (events were trimmed or lost), which triggers a resync of that worker from
its gRPC ``Snapshot``.

Discovery trusts only signed entries: each must carry a valid HMAC under the cluster token (auth/signing.py); an
unsigned or forged one is ignored and logged (once per distinct entry). Redis is a directory, not the judge of
liveness: a worker whose entry is missing but that still answers its probes (``Worker.answering``) is kept, so a
Redis that restarts empty, or an entry lost to a network blip, never closes a healthy worker's channels under its
in-flight requests; its worker writes the entry again on its next heartbeat. A worker is removed once its entry is
gone and it has stopped answering too. After an outage the KV stream resumes with a sequence gap per worker
(events published meanwhile were lost), which resyncs that worker from its ``Snapshot``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import redis.asyncio as aioredis

from auth.signing import BadSignature, verify
from auth.tls import TLSFiles, redis_tls_kwargs
from router.pool import WorkerPool
from wire.redis_keys import KVEventEntry, kv_stream_key, worker_pattern

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """What the bus needs of the KV index (router.kv_index.KVIndex): apply one worker's event batch."""

    def apply(self, worker_id: str, seq: int, hashes: list[int], kinds: bytes) -> bool: ...


class RedisBus:
    def __init__(self, url: str, model_key: str, index: EventSink, pool: WorkerPool,
                 resync: Callable[[str], Awaitable[int | None]] | None = None, discover_interval_s: float = 0.5,
                 token: str | None = None, tls: TLSFiles | None = None) -> None:
        """``token``: the cluster token that worker entries must be signed with (without one, every entry is
        ignored); ``tls``: the certificate and CA for a ``rediss://`` URL. Both default to the pool's."""
        tls = tls if tls is not None else pool.credentials.tls
        self.client = aioredis.Redis.from_url(url, socket_timeout=5.0,
                                              **redis_tls_kwargs(url, tls))  # type: ignore[arg-type]
        self.token = token if token is not None else pool.credentials.token
        self.refused: dict[bytes | str, str] = {}  # entries ignored (raw value -> why), each logged once
        self.model_key = model_key
        self.index = index
        self.pool = pool
        self.resync = resync
        self.discover_interval_s = discover_interval_s
        self.last_seq: dict[str, int] = {}
        self.applied = 0
        self.stream_id = b"0-0"
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.discover()
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._discover_loop())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    async def ads(self) -> dict[str, dict[str, object]]:
        """The signed worker entries, by address."""
        out: dict[str, dict[str, object]] = {}
        async for key in self.client.scan_iter(match=worker_pattern(self.model_key), count=500):
            raw = await self.client.get(key)
            if raw:
                ad = self._verified(key, raw)
                if ad is not None:
                    out[str(ad["address"])] = ad
        return out

    def _verified(self, key: bytes | str, raw: bytes | str) -> dict[str, object] | None:
        try:
            if self.token is None:
                raise BadSignature("this router holds no cluster token to check it with")
            ad = verify(raw, self.token)
            if not isinstance(ad.get("address"), str):
                raise BadSignature("no address")
            return ad
        except BadSignature as e:
            if raw not in self.refused:
                if len(self.refused) > 1024:
                    self.refused.clear()
                self.refused[raw] = str(e)
                name = key.decode(errors="replace") if isinstance(key, bytes) else key
                log.warning("ignoring registry entry %s: %s", name, e)
            return None

    async def discover(self) -> None:
        """Add workers with a live lease; drop those whose lease expired; mirror the draining flag and the LoRA
        adapters served (name -> content hash; which are loaded comes from the worker's Health)."""
        ads = await self.ads()
        for address, ad in ads.items():
            w = self.pool.workers.get(address) or self.pool.add(address)
            w.draining = bool(ad.get("draining"))
            loras = ad.get("loras")
            if isinstance(loras, dict) and loras.keys() != w.loras.keys():  # an adapter loaded or unloaded
                w.loras = {str(k): str(v) for k, v in loras.items()}
                w.resident_loras = w.resident_loras.intersection(w.loras)
        for address, w in list(self.pool.workers.items()):
            if address not in ads and not w.answering:
                log.info("worker %s: lease expired and it answers no probe; removing it", address)
                self.last_seq.pop(w.worker_id, None)
                await self.pool.remove(address)

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discover_interval_s)
            try:
                await self.discover()
            except aioredis.RedisError as e:
                log.warning("redis discovery: %s", e)

    async def _follow(self) -> None:
        stream = kv_stream_key(self.model_key)
        while True:
            try:
                resp = await self.client.xread({stream: self.stream_id}, count=1000, block=500)
            except aioredis.RedisError as e:
                log.warning("redis stream: %s", e)
                await asyncio.sleep(0.5)
                continue
            # RESP2, undecoded: [[stream, [(entry_id, {field: value}), ...]], ...] (redis' annotation is the union
            # over protocols and decodings)
            for _, entries in cast("list[list[Any]]", resp) or ():
                for entry_id, fields in entries:
                    self.stream_id = entry_id
                    await self._apply(fields)

    async def _apply(self, fields: dict[bytes, bytes]) -> None:
        entry = KVEventEntry.from_fields(fields)
        worker, seq = entry.worker_id, entry.seq
        last = self.last_seq.get(worker)
        if last is not None and seq <= last:
            return  # already covered (e.g. by a snapshot)
        if last is None and seq != 1 and self.resync is not None:
            last = await self.resync(worker)  # joined late: start from the worker's snapshot
            if last is not None:
                self.last_seq[worker] = last
                if seq <= last:
                    return
        if not self.index.apply(worker, seq, entry.hashes, entry.kinds):
            if self.resync is not None:
                snap = await self.resync(worker)
                if snap is not None:
                    self.last_seq[worker] = snap
            return
        self.last_seq[worker] = seq
        self.applied += 1
