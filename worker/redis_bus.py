"""A worker's side of the Redis bus: a registry lease with heartbeats, and its KV events on the shared stream.

Keys (``P`` = ``tandem:<model key>``):

- ``P:worker:<worker_id>``: JSON ``{address, role, worker_id, compat_hash, draining, loras, sig}`` (``loras``: the
  LoRA adapters it serves, name -> content hash, rewritten at once when one is loaded or unloaded), signed with the
  cluster token (auth/signing.py: routers ignore an entry whose ``sig`` does not check), set with a TTL of
  ``lease_s`` and refreshed every ``lease_s / 3``. A worker that dies simply stops refreshing: its entry
  vanishes within one lease. A Redis that restarts empty has every live worker's entry back within one refresh,
  as the next heartbeat writes it again (the client reconnects on its own).
- ``P:kv``: one Redis Stream for every worker's KV event batches (fields ``w`` worker id, ``s`` sequence number,
  ``h`` hashes as packed little-endian u64, ``k`` kinds). One stream means one global order, so every router
  replica that reads it applies the same events in the same order and builds the same index.

All Redis I/O happens on this publisher's own thread; the engine loop only enqueues.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from dataclasses import dataclass, field

import redis

from auth.signing import sign
from auth.tls import TLSFiles, redis_tls_kwargs
from engine.block_pool import KVEventBatch
from wire.redis_keys import kv_event_fields, kv_stream_key, worker_key

log = logging.getLogger(__name__)
STREAM_MAXLEN = 1_000_000


@dataclass(slots=True)
class WorkerAd:
    worker_id: str
    address: str
    role: str
    compat_hash: str
    draining: bool = False
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> content hash (worker/lora_admin.py)

    def to_dict(self) -> dict[str, object]:
        return {"worker_id": self.worker_id, "address": self.address, "role": self.role,
                "compat_hash": self.compat_hash, "draining": self.draining, "loras": dict(self.loras)}

    def to_json(self, token: str | None = None) -> str:
        """The entry as JSON, signed when there is a ``token``."""
        return json.dumps(self.to_dict()) if token is None else sign(self.to_dict(), token)


class RedisPublisher:
    def __init__(self, url: str, model_key: str, ad: WorkerAd, lease_s: float = 3.0, token: str | None = None,
                 tls: TLSFiles | None = None) -> None:
        """``token``: the cluster token that signs the entry (unsigned without: routers ignore it); ``tls``: the
        certificate and CA for a ``rediss://`` URL."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                           **redis_tls_kwargs(url, tls))  # type: ignore[arg-type]
        self.token = token
        self.model_key = model_key
        self.ad = ad
        self.lease_s = lease_s
        self._q: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-publisher", daemon=True)

    @property
    def lease_key(self) -> str:
        return worker_key(self.model_key, self.ad.worker_id)

    def start(self) -> None:
        self._heartbeat()  # registered before the worker says READY
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        self._q.put(batch)

    def set_draining(self) -> None:
        self.ad.draining = True
        try:
            self._heartbeat()
        except redis.RedisError as e:  # Redis is away: the publisher thread's next heartbeat carries the flag
            log.warning("redis publisher: draining flag not written yet: %s", e)

    def set_loras(self, loras: dict[str, str]) -> None:
        """The adapters served changed: rewrite the entry now (else the next heartbeat carries them)."""
        self.ad.loras = dict(loras)
        try:
            self._heartbeat()
        except redis.RedisError as e:
            log.warning("redis publisher: adapter list not written yet: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join(2.0)
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.lease_key)
        self.client.close()

    def _heartbeat(self) -> None:
        self.client.set(self.lease_key, self.ad.to_json(self.token), px=int(self.lease_s * 1000))

    def _run(self) -> None:
        interval = self.lease_s / 3
        while not self._stop.is_set():
            try:
                self._heartbeat()
                batch = self._q.get(timeout=interval)
                pipe = self.client.pipeline(transaction=False)
                while batch is not None:
                    pipe.xadd(kv_stream_key(self.model_key),
                              kv_event_fields(self.ad.worker_id, batch.seq, batch.hashes, batch.kinds),  # type: ignore[arg-type]
                              maxlen=STREAM_MAXLEN, approximate=True)
                    try:
                        batch = self._q.get_nowait()
                    except queue.Empty:
                        break
                pipe.execute()
            except queue.Empty:
                continue
            except redis.RedisError as e:
                log.warning("redis publisher: %s", e)
                self._stop.wait(0.5)
